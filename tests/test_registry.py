"""The model registry against a real Engine: on-demand loads, keep_alive, eviction, models_dir.

Loading is the session's already-loaded SmolLM2 (conftest `llm`), handed out by a counting
loader, so each "load" costs an engine.add_model, not a 15 s GGUF parse.
"""

import asyncio
import json
import os
import threading
import time

import pytest

from gpushare.settings.settings import ModelEntry, Settings
from gpushare.engine.engine import Engine, EngineConfig
from gpushare.residency.registry import ModelLoadError, ModelNotFound, Registry, RegistrationError, RegistryFull
from gpushare.engine.local_device import LocalDevice


class CountingLoader:
    def __init__(self, loaded_model, delay_s: float = 0.0, fail: bool = False):
        self.loaded_model = loaded_model
        self.delay_s = delay_s
        self.fail = fail
        self.calls: list[str] = []

    def __call__(self, path, dtype, device, progress, weights="auto"):
        self.calls.append(path)
        time.sleep(self.delay_s)
        if self.fail:
            raise ValueError(f"{path}: corrupt or truncated GGUF file")
        return self.loaded_model


@pytest.fixture
def engine():
    e = Engine(EngineConfig(max_num_seqs=2, max_num_batched_tokens=256, kv_cache_bytes=8 << 20))
    e.start()
    yield e
    e.shutdown()


def make_registry(engine, tmp_path, smollm2_path, loader, names=("a", "b", "c"), **memory):
    settings = Settings(models=[ModelEntry(n, smollm2_path) for n in names], models_dir=tmp_path / "models")
    settings.memory.kv_budget_bytes = 8 << 20
    settings.memory.max_loaded_models = memory.get("max_loaded_models", 2)
    settings.engine.max_num_seqs = engine.config.max_num_seqs
    settings.server.max_queued = 1
    return Registry({"cpu": LocalDevice(engine, loader=loader)}, settings, dtype="float32")


def loaded_names(engine) -> set[str]:
    return set(engine.stats().models)


async def eventually(predicate, timeout_s: float = 10) -> bool:
    """Poll on the event loop: removal from the engine finishes in a worker thread."""
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return predicate()


def test_concurrent_requests_load_once(engine, tmp_path, smollm2_path, llm):
    loader = CountingLoader(llm.model, delay_s=0.3)
    reg = make_registry(engine, tmp_path, smollm2_path, loader)

    async def one():
        async with reg.use("a") as lease:
            await asyncio.sleep(0.05)
            return lease

    async def main():
        return await asyncio.gather(one(), one(), one())

    leases = asyncio.run(main())
    assert len(loader.calls) == 1 and loaded_names(engine) == {"a"}
    assert len({id(lease.entry) for lease in leases}) == 1
    assert all(lease.load_duration_s >= 0.25 for lease in leases)  # each waited for the one load


def test_keep_alive_zero_unloads_after_the_request_and_a_timer_otherwise(engine, tmp_path, smollm2_path, llm):
    reg = make_registry(engine, tmp_path, smollm2_path, CountingLoader(llm.model))

    async def main():
        async with reg.use("a", keep_alive_s=0):
            assert loaded_names(engine) == {"a"}
        assert await eventually(lambda: loaded_names(engine) == set())
        async with reg.use("b", keep_alive_s=0.5):
            pass
        await asyncio.sleep(0.3)
        async with reg.use("b", keep_alive_s=0.5):  # resets the timer
            pass
        await asyncio.sleep(0.3)
        assert "b" in loaded_names(engine)  # 0.6 s after its first use, 0.3 s after the second
        assert await eventually(lambda: "b" not in loaded_names(engine))
        async with reg.use("c", keep_alive_s=-1):
            pass
        assert reg.get_loaded("c").expires_at is None

    asyncio.run(main())


def test_keep_alive_precedence_request_then_model_then_server(engine, tmp_path, smollm2_path, llm):
    reg = make_registry(engine, tmp_path, smollm2_path, CountingLoader(llm.model))
    reg.settings.models[0].keep_alive_s = 60.0
    reg.settings.server.keep_alive_s = 7.0

    async def main():
        await reg.load("a")
        await reg.load("b")
        assert reg.get_loaded("a").keep_alive_s == 60.0  # the model's own
        assert reg.get_loaded("b").keep_alive_s == 7.0  # the server default
        await reg.load("a", keep_alive_s=3.0)
        assert reg.get_loaded("a").keep_alive_s == 3.0
        assert abs(reg.get_loaded("a").expires_at - (time.time() + 3.0)) < 1
        await reg.close()

    asyncio.run(main())


def test_a_busy_model_is_never_unloaded(engine, tmp_path, smollm2_path, llm):
    reg = make_registry(engine, tmp_path, smollm2_path, CountingLoader(llm.model))

    async def main():
        async with reg.use("a", keep_alive_s=0.1):
            await reg.unload("a")
            await asyncio.sleep(0.3)
            assert loaded_names(engine) == {"a"}
        assert await eventually(lambda: loaded_names(engine) == set())

    asyncio.run(main())


def test_idle_models_are_evicted_least_recently_used_first(engine, tmp_path, smollm2_path, llm):
    reg = make_registry(engine, tmp_path, smollm2_path, CountingLoader(llm.model), max_loaded_models=2)

    async def main():
        await reg.load("a")
        await reg.load("b")
        await reg.load("a")  # a is now the more recent
        await reg.load("c")
        assert loaded_names(engine) == {"a", "c"}
        reg.residency.room_wait_timeout_s = 0.3
        async with reg.use("a"), reg.use("c"):
            with pytest.raises(RegistryFull, match="the 2 busy models holding the rest stayed busy") as full:
                await reg.load("b")  # both busy: b waited, then gave up
            # the busy models go unnamed: the asker's allow-list may not list them (the log names them)
            assert '"a"' not in str(full.value) and '"c"' not in str(full.value) and "(a, c)" not in str(full.value)
        await reg.close()

    asyncio.run(main())


def test_each_loaded_model_may_grow_into_the_whole_kv_pool(engine, tmp_path, smollm2_path, llm):
    from gpushare.engine.kv_pool import kv_bytes_per_block

    reg = make_registry(engine, tmp_path, smollm2_path, CountingLoader(llm.model), max_loaded_models=2)

    async def main():
        await reg.load("a")
        await reg.load("b")

    asyncio.run(main())
    per_block = kv_bytes_per_block(llm.model.config, engine.config.block_size, engine.kv_dtype)
    stats = engine.stats()
    assert stats.models["a"].blocks_total == stats.models["b"].blocks_total == (8 << 20) // per_block
    assert stats.kv_committed_bytes == 0  # nothing ran: no model holds a slab


def test_too_many_requests_for_one_model_is_full(engine, tmp_path, smollm2_path, llm):
    reg = make_registry(engine, tmp_path, smollm2_path, CountingLoader(llm.model))
    assert reg.max_requests_per_model == 3  # max_num_seqs 2 + max_queued 1

    async def main():
        async with reg.use("a"), reg.use("a"), reg.use("a"):
            with pytest.raises(RegistryFull, match="3 requests in flight"):
                async with reg.use("a"):
                    pass
        await reg.close()

    asyncio.run(main())


def test_unknown_models_and_latest_tag(engine, tmp_path, smollm2_path, llm):
    reg = make_registry(engine, tmp_path, smollm2_path, CountingLoader(llm.model), names=("tiny:latest",))
    assert reg.find("tiny").name == "tiny:latest"
    with pytest.raises(ModelNotFound, match='model "nope" not found'):
        reg.find("nope")


def test_a_failed_load_is_reported_and_retried(engine, tmp_path, smollm2_path, llm):
    loader = CountingLoader(llm.model, fail=True)
    reg = make_registry(engine, tmp_path, smollm2_path, loader)

    async def main():
        with pytest.raises(ModelLoadError, match='failed to load model "a": .*corrupt'):
            await reg.load("a")
        loader.fail = False
        await reg.load("a")
        await reg.close()

    asyncio.run(main())
    assert len(loader.calls) == 2


def test_models_dir_scan_create_and_remove(engine, tmp_path, smollm2_path, llm):
    reg = make_registry(engine, tmp_path, smollm2_path, CountingLoader(llm.model), names=("a",))
    hf = tmp_path / "hf-model"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    created = reg.create("mine:q4", smollm2_path)
    assert created.origin == "models_dir" and os.path.realpath(created.path) == os.path.realpath(smollm2_path)
    reg.create("folder", str(hf))
    reg.create("alias", "a")  # from a model name
    assert {"a", "mine:q4", "folder", "alias"} <= set(reg.sources())
    reg.create("mine:q4", smollm2_path)  # ours: replaced, as `ollama create` does
    with pytest.raises(RegistrationError, match='"a" already exists and cannot be replaced: .* defined in the config'):
        reg.create("a", smollm2_path)
    with pytest.raises(RegistrationError, match="neither a GGUF file"):
        reg.create("bad", str(tmp_path))
    asyncio.run(reg.remove("mine:q4"))
    assert "mine:q4" not in reg.sources() and os.path.exists(smollm2_path)
    with pytest.raises(RegistrationError, match="defined in the config file"):
        asyncio.run(reg.remove("a"))
    (reg.settings.models_dir / "copied.gguf").write_bytes(b"GGUF")
    with pytest.raises(RegistrationError, match="delete it yourself"):
        asyncio.run(reg.remove("copied"))


def test_size_estimate_from_the_file_header_equals_the_loaded_size(smollm2_path, llm, tmp_path):
    from gpushare.residency.memory_budget import count_tensors, estimate_weight_bytes

    count = count_tensors(smollm2_path)
    assert count.parameters == sum(p.numel() for p in llm.model.model.parameters()) + sum(
        m.packed.numel() for m in llm.model.model.modules() if getattr(m, "packed", None) is not None
    ) - count.tied_embedding  # every weight once: the packed oneDNN copies replace the dense ones
    assert estimate_weight_bytes(count, "float32") == llm.model.weight_bytes  # CPU float32: exact
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(smollm2_path, "rb").read(4096))
    with pytest.raises(ValueError, match="cut.gguf: corrupt or truncated GGUF file"):
        count_tensors(str(cut))


@pytest.fixture
def two_engines():
    engines = [Engine(EngineConfig(max_num_seqs=2, max_num_batched_tokens=256, kv_cache_bytes=8 << 20))
               for _ in range(2)]
    for e in engines:
        e.start()
    yield engines
    for e in engines:
        e.shutdown()


def two_device_registry(engines, tmp_path, smollm2_path, loader, models: list[ModelEntry]) -> Registry:
    settings = Settings(models=models, models_dir=tmp_path / "models")
    settings.memory.kv_budget_bytes = 8 << 20
    settings.memory.max_loaded_models = 2
    settings.engine.max_num_seqs = 2
    settings.server.max_queued = 4
    devices = {f"cpu:{i}": LocalDevice(e, name=f"cpu:{i}", loader=loader) for i, e in enumerate(engines)}
    return Registry(devices, settings, dtype="float32")


def test_a_model_loads_on_its_device_else_where_the_least_work_is(two_engines, tmp_path, smollm2_path, llm):
    models = [ModelEntry("pinned", smollm2_path, device="cpu:1"), ModelEntry("a", smollm2_path),
              ModelEntry("b", smollm2_path)]
    reg = two_device_registry(two_engines, tmp_path, smollm2_path, CountingLoader(llm.model), models)

    async def main():
        async with reg.use("pinned") as pinned:
            async with reg.use("a") as a:  # cpu:1 has a request in flight: cpu:0 has less work
                async with reg.use("b") as b:  # one request each now: the first device in order
                    return pinned.entry.device_name, a.entry.device_name, b.entry.device_name

    assert asyncio.run(main()) == ("cpu:1", "cpu:0", "cpu:0")
    assert loaded_names(two_engines[0]) == {"a", "b"} and loaded_names(two_engines[1]) == {"pinned"}


def test_a_model_with_replicas_gets_a_copy_per_device_and_requests_spread(two_engines, tmp_path, smollm2_path,
                                                                           llm):
    loader = CountingLoader(llm.model)
    reg = two_device_registry(two_engines, tmp_path, smollm2_path, loader,
                              [ModelEntry("r", smollm2_path, replicas=2)])

    async def main():
        async with reg.use("r") as first:
            first.hold_tokens(500)  # a long request
            assert await eventually(lambda: len(reg.loaded()) == 2)  # the second copy loads in the background
            async with reg.use("r") as second:  # the copy with nothing outstanding
                second.hold_tokens(100)
                async with reg.use("r") as third:  # 100 tokens outstanding there, 500 on the first copy
                    devices = [first.entry.device_name, second.entry.device_name, third.entry.device_name]
        await reg.unload("r")
        return devices

    first, second, third = asyncio.run(main())
    assert first != second and third == second
    assert len(loader.calls) == 2
    assert loaded_names(two_engines[0]) == set() and loaded_names(two_engines[1]) == set()


def test_a_dead_device_loses_its_models_and_loads_wait_until_it_is_back(two_engines, tmp_path, smollm2_path, llm):
    reg = two_device_registry(two_engines, tmp_path, smollm2_path, CountingLoader(llm.model),
                              [ModelEntry("m", smollm2_path, device="cpu:0")])
    healthy = {"cpu:0": True, "cpu:1": True}
    reg.residency.is_healthy = healthy.__getitem__

    async def main():
        await reg.load("m")
        healthy["cpu:0"] = False
        reg.forget_device("cpu:0")  # what the supervisor does when the worker dies
        assert reg.loaded() == []
        waiting = asyncio.create_task(reg.load("m"))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # its device is restarting
        await asyncio.to_thread(two_engines[0].remove_model, "m")  # a restarted worker starts empty
        healthy["cpu:0"] = True
        reg.device_back("cpu:0")
        lease = await asyncio.wait_for(waiting, 10)
        return lease.entry.device_name

    assert asyncio.run(main()) == "cpu:0"


def test_a_tenant_kv_limit_counts_across_devices(two_engines, llm):
    """What the tenant holds on one device comes off its kv_limit on the other (NodeDevices)."""
    from gpushare.protocol.sampling_params import SamplingParams
    from gpushare.protocol.tenant_policy import TenantPolicy
    from gpushare.residency.node_devices import NodeDevices

    devices = {f"cpu:{i}": LocalDevice(e, name=f"cpu:{i}") for i, e in enumerate(two_engines)}
    for e in two_engines:
        e.add_model("m", llm.model)
    per_token = two_engines[0].stats().models["m"].block_bytes // 16
    node = NodeDevices(devices)
    node.set_tenants([TenantPolicy("t", kv_limit_bytes=200 * per_token, kv_limit_tokens=300), TenantPolicy("free")])
    assert two_engines[1].tenant_policies["t"].kv_limit_bytes == 200 * per_token  # nothing held anywhere yet

    started, finished = threading.Event(), threading.Event()

    def on_output(out):
        started.set()
        if out.finished:
            finished.set()

    ids = llm.tokenizer.encode(llm.model.render_chat([{"role": "user", "content": "Tell me a long story."}]),
                               add_special_tokens=False)
    request = two_engines[0].request("m", ids, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                                     tenant="t")
    two_engines[0].submit(request, on_output)
    assert started.wait(60)
    held = two_engines[0].tenant_stats()["t"].kv_used_bytes
    assert held > 0
    node.balance_kv_limits()
    other = two_engines[1].tenant_policies
    assert other["t"].kv_limit_bytes == 200 * per_token - held
    assert other["t"].kv_limit_tokens == 300 - held // per_token
    assert other["free"] == node.tenant_policies["free"]  # no limit: nothing to share
    assert two_engines[0].tenant_policies["t"] == node.tenant_policies["t"]  # it holds nothing elsewhere
    two_engines[0].cancel(request.request_id)
    assert finished.wait(60)
    assert eventually_sync(lambda: two_engines[0].tenant_stats().get("t") is not None
                           and two_engines[0].tenant_stats()["t"].kv_used_bytes == 0)
    node.balance_kv_limits()
    assert two_engines[1].tenant_policies["t"] == node.tenant_policies["t"]


def eventually_sync(predicate, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def test_a_gpu_with_ecc_errors_is_marked_unhealthy_and_gets_no_new_model(two_engines, tmp_path, smollm2_path, llm):
    """DeviceSupervisor's NVML check, on the fake built from the recorded 8xH100 `nvidia-smi -q`."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "node"))
    from node_fakes import FakeNvml, h100_node_gpus

    from gpushare.node.gpu_health import XidWatch
    from gpushare.residency.device_supervisor import DeviceSupervisor

    gpus = h100_node_gpus()[:2]
    nvml = FakeNvml(gpus)
    reg = two_device_registry(two_engines, tmp_path, smollm2_path, CountingLoader(llm.model),
                              [ModelEntry("a", smollm2_path), ModelEntry("b", smollm2_path)])
    supervisor = DeviceSupervisor(reg.devices, {"cpu:0": gpus[0].uuid, "cpu:1": gpus[1].uuid}, nvml=nvml)
    reg.residency.is_healthy = supervisor.healthy
    gpus[0].volatile_uncorrected_ecc = 2

    async def main():
        xids = XidWatch([g.uuid for g in gpus], nvml)
        try:
            await supervisor.check_health(xids)
        finally:
            xids.close()
        async with reg.use("a") as a:  # cpu:0 would have been first in order, with no work either side
            async with reg.use("b") as b:  # cpu:1 now has a request: still not the faulty one
                return a.entry.device_name, b.entry.device_name

    assert asyncio.run(main()) == ("cpu:1", "cpu:1")
    assert not supervisor.healthy("cpu:0") and supervisor.healthy("cpu:1")
    assert "2 uncorrected ECC error(s)" in supervisor.status["cpu:0"].reason
