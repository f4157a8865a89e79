"""The typed messages between the supervisor and an engine worker process (engine/worker.py).

They travel pickled over a multiprocessing Connection on a socket pair. Supervisor -> worker:
the WorkerSpec (with its GroupSpec on a tensor-parallel rank) once, then requests (Submit, Cancel, Embed), model moves (LoadModel,
UnloadModel, DropWarm, and a LoRA adapter's AttachAdapter and DetachAdapter on a loaded base), settings (SetTenants, SetShareWeight) and Stop. Worker -> supervisor:
Ready once, then Outputs (every output of one engine loop turn, in one message), Snapshot (the
engine's state after that turn), Progress of a load and the Reply to each call.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpushare.protocol.engine_config import EngineConfig
from gpushare.protocol.engine_stats import EngineSnapshot
from gpushare.protocol.request import EmbedRequest, GenerationRequest
from gpushare.protocol.outputs import RequestOutput
from gpushare.protocol.tenant_policy import TenantPolicy


@dataclass
class GroupSpec:
    """One rank's place in its tensor-parallel group (engine/tp_runtime.py)."""

    rank: int
    world_size: int
    init_file: str  # torch.distributed's file rendezvous, fresh for each start of the group
    devices: list[str]  # the group's devices in rank order, for logs and ps


@dataclass
class WorkerSpec:
    name: str  # the device, as engine.devices names it ("cpu:0", "cuda:1", "MIG-...")
    config: EngineConfig  # its cpus and num_threads pin the engine thread and torch's pool
    group: GroupSpec | None = None  # a rank of a tensor-parallel group (engine/tp_runtime.py)


@dataclass
class Ready:
    pid: int


# ---- supervisor -> worker -------------------------------------------------------------------

@dataclass
class Submit:
    request: GenerationRequest


@dataclass
class Cancel:
    request_id: str


@dataclass
class Embed:
    call_id: int
    request: EmbedRequest


@dataclass
class LoadModel:
    call_id: int
    name: str
    path: str
    dtype: str
    weights: str
    share_weight: float
    warm_key: tuple | None = None  # load from the worker's warm tier when it holds this key


@dataclass
class UnloadModel:
    call_id: int
    name: str
    warm_key: tuple | None = None  # keep the model warm under this key


@dataclass
class AttachAdapter:
    """Serve the LoRA adapter at `path` as model `name` on loaded model `base`; the reply is its bytes."""
    call_id: int
    name: str
    base: str
    path: str


@dataclass
class DetachAdapter:
    call_id: int
    name: str


@dataclass
class DropWarm:
    warm_key: tuple


@dataclass
class SetTenants:
    policies: list[TenantPolicy]


@dataclass
class SetShareWeight:
    name: str
    share_weight: float


@dataclass
class Stop:
    pass


# ---- worker -> supervisor -------------------------------------------------------------------

@dataclass
class Outputs:
    items: list[tuple[str, RequestOutput]]  # (the submitted request's id, one of its outputs)


@dataclass
class Snapshot:
    snapshot: EngineSnapshot


@dataclass
class Progress:
    call_id: int
    done_bytes: int
    total_bytes: int


@dataclass
class Loaded:
    """A LoadModel's reply value."""
    weights: str  # the format it was built in
    weight_bytes: int
    warm: bool  # taken from the worker's warm tier
    kernel: str  # the kernels its linears run on (LoadedModel.kernel)


@dataclass
class Reply:
    call_id: int
    value: object = None
    error: BaseException | None = None
