"""Tensor-parallel groups for the daemon: planned from the config and the node (node/tp_groups.py),
checked against each model's heads, and built as one GroupClient (residency/group_client.py) per
set of devices. Models whose groups name the same devices in the same order share one group.
"""

from __future__ import annotations

import logging

from gpushare.settings.settings import ConfigError, Settings
from gpushare.protocol.messages import GroupSpec, WorkerSpec
from gpushare.residency.group_client import GroupClient
from gpushare.residency.worker_client import WorkerClient

log = logging.getLogger("gpushare.daemon")


def plan_groups(settings: Settings, plans) -> list:
    """Each tensor-parallel model's TPGroupPlan, in config order; ConfigError names the model and
    what it cannot have (more devices than there are, a split its heads do not allow, SYS links)."""
    from gpushare.catalog.model_head import read_model_info
    from gpushare.catalog.tensor_split import split_model
    from gpushare.node.gpu_links import GpuLinks, read_gpu_links
    from gpushare.node.runner import NodeError, SubprocessRunner
    from gpushare.node.tp_groups import plan_tp_groups

    models = [m for m in settings.models if m.tensor_parallel != 1 or m.tensor_parallel_devices]
    if not models:
        return []
    if settings.engine.isolation != "process":
        raise ConfigError(f"models: {models[0].name} is tensor-parallel, which needs engine.isolation: process "
                          "(one worker process per rank)")
    links = GpuLinks()
    if any(w.torch_device == "cuda" for w in plans.workers):
        try:
            links = read_gpu_links(SubprocessRunner())
        except NodeError as e:
            log.warning("nvidia-smi topo -m failed (%s): every GPU pair counts as cross-socket", e)
    try:
        groups = plan_tp_groups(settings.models, plans, links, _need_bytes(settings, models, plans))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    index = {m.name: i for i, m in enumerate(settings.models)}
    for group in groups:
        config, _, _ = read_model_info(next(m.path for m in models if m.name == group.model))
        try:
            split_model(config, len(group.workers), f"models[{index[group.model]}] {group.model}")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return [g for g in groups if len(g.workers) > 1]  # auto may find one device enough


def _need_bytes(settings: Settings, models, plans) -> dict[str, int]:
    """Weights (estimated from the file) plus one KV pool, for tensor_parallel: auto."""
    from gpushare.protocol.weight_format import resolve_weights
    from gpushare.residency.memory_budget import count_tensors, estimate_weight_bytes

    kind = "cuda" if any(w.torch_device == "cuda" for w in plans.workers) else "cpu"
    need = {}
    for model in models:
        if model.tensor_parallel == "auto":
            count = count_tensors(model.path)
            weights = resolve_weights(model.weights or settings.engine.weights, kind, set(count.source_types))
            need[model.name] = estimate_weight_bytes(count, weights) + settings.memory.kv_budget_bytes
    return need


def group_clients(settings: Settings, groups, rank_config) -> tuple[dict[str, GroupClient], dict[str, str]]:
    """(group device name -> its GroupClient, model -> its group's device name). ``rank_config(plan)``:
    the EngineConfig of a worker on that device."""
    clients: dict[str, GroupClient] = {}
    model_groups = {}
    for group in groups:
        names = [w.name for w in group.workers]
        name = "+".join(names)
        if name not in clients:
            ranks = [WorkerClient(WorkerSpec(w.name, _on_rank_gpu(rank_config(w), w, i, group.workers),
                                             GroupSpec(i, len(names), "", names)),
                                  _rank_env(w, group.workers), settings.memory.kv_budget_bytes)
                     for i, w in enumerate(group.workers)]
            clients[name] = GroupClient(ranks)
        model_groups[group.model] = name
        log.info("tensor parallel: %s over %s (%s): %s", group.model, ", ".join(names), group.link, group.why)
    return clients, model_groups


def _rank_env(worker, workers) -> dict[str, str]:
    """A GPU rank sees every GPU of its group, in rank order, so that NCCL can reach its peers
    directly (NVLink, PCIe peer to peer): a process that sees only its own GPU cannot. MIG
    instances have no peer path and keep their one device."""
    if worker.torch_device != "cuda" or worker.mig_uuid is not None:
        return worker.env
    return {**worker.env, "CUDA_VISIBLE_DEVICES": ",".join(w.gpu_uuid for w in workers)}


def _on_rank_gpu(config, worker, rank: int, workers):
    """The rank's engine on its own GPU among those it sees (_rank_env)."""
    if worker.torch_device == "cuda" and worker.mig_uuid is None:
        config.device = f"cuda:{rank}"
    return config
