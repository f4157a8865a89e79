"""LoRA adapters' residency against a real Engine and Registry (in this process): an adapter loads its base
once and then only itself, leaves by its own keep_alive and LRU, never counts against max_loaded_models,
holds its base while attached, and goes first when its base goes. The base is a tiny random Llama loaded
once per module, handed out by a counting loader; the adapters are GGUF LoRAs of random numbers (what
they answer is tests/test_lora_oracle.py's and tests/test_api_lora.py's business)."""

import asyncio

import numpy as np
import pytest

from gpushare.engine.local_device import LocalDevice
from gpushare.models.loader import load_model
from gpushare.models.lora import target_shape
from gpushare.residency.registry import Registry
from gpushare.settings.settings import ModelEntry, Settings
from test_registry import CountingLoader, engine, eventually, loaded_names  # noqa: F401 (engine: the fixture)
from tests.model_files import random_llama_folder


def write_lora(path: str, config, rank: int, seed: int) -> str:
    """A GGUF LoRA on layer 0's v and down projections."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(rank))
    for gguf_name, target in (("attn_v", "v"), ("ffn_down", "down")):
        out_features, in_features = target_shape(config, target)
        writer.add_tensor(f"blk.0.{gguf_name}.weight.lora_a", rng.standard_normal((rank, in_features), np.float32))
        writer.add_tensor(f"blk.0.{gguf_name}.weight.lora_b", rng.standard_normal((out_features, rank), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_path):
    """(the base's folder, its loaded model, {adapter name: GGUF LoRA path})."""
    root = tmp_path_factory.mktemp("adapter-residency")
    folder = random_llama_folder(smollm2_path, str(root / "base"))
    model = load_model(folder, weights="float32")
    loras = {name: write_lora(str(root / f"{name}.gguf"), model.config, 8, seed)
             for seed, name in enumerate(["x", "y"])}
    return folder, model, loras


def make_registry(engine, tmp_path, tiny, max_loaded_models: int = 2) -> tuple[Registry, CountingLoader]:
    folder, model, loras = tiny
    loader = CountingLoader(model)
    settings = Settings(models=[ModelEntry("base", folder), ModelEntry("other", folder),
                                *(ModelEntry(name, "", adapter=path, base="base") for name, path in loras.items())],
                        models_dir=tmp_path / "models")
    settings.memory.kv_budget_bytes = engine.config.kv_cache_bytes
    settings.memory.max_loaded_models = max_loaded_models
    return Registry({"cpu": LocalDevice(engine, loader=loader)}, settings, dtype="float32"), loader


def test_an_adapter_loads_its_base_once_then_only_itself_and_leaves_by_its_keep_alive(engine, tmp_path, tiny):
    reg, loader = make_registry(engine, tmp_path, tiny)

    async def main():
        async with reg.use("x", keep_alive_s=0) as lease:
            assert engine.adapter_bases == {"x": "base"} and loaded_names(engine) == {"base"}
            assert 0 < lease.entry.weight_bytes < reg.get_loaded("base").weight_bytes
        assert await eventually(lambda: engine.adapter_bases == {})
        assert loaded_names(engine) == {"base"}  # the base stays, on its own keep_alive
        await reg.load("y")
        await reg.load("x")
        assert engine.adapter_bases == {"x": "base", "y": "base"} and len(loader.calls) == 1
        await reg.close()

    asyncio.run(main())


def test_the_base_stays_while_an_adapter_is_attached_and_unloading_it_detaches_them_first(engine, tmp_path, tiny):
    reg, _ = make_registry(engine, tmp_path, tiny)

    async def main():
        await reg.load("x", keep_alive_s=-1)
        async with reg.use("base", keep_alive_s=0):
            pass
        await asyncio.sleep(0.3)
        assert loaded_names(engine) == {"base"} and engine.adapter_bases == {"x": "base"}
        assert await reg.unload("base")
        assert await eventually(lambda: loaded_names(engine) == set())
        assert engine.adapter_bases == {} and reg.loaded() == []

    asyncio.run(main())


def test_adapters_count_in_the_budget_least_recently_used_first_never_as_models(engine, tmp_path, tiny):
    reg, loader = make_registry(engine, tmp_path, tiny, max_loaded_models=1)

    async def main():
        await reg.load("x")
        await reg.load("y")  # one model loaded: base; two adapters do not count
        assert engine.adapter_bases == {"x": "base", "y": "base"}
        await reg.load("x")  # x is now the more recent
        adapter_bytes = reg.get_loaded("y").size_bytes
        await reg.unload("y")
        reg.residency.budget_bytes = reg.residency.used_bytes("cpu") + adapter_bytes // 2  # room for no second
        await reg.load("y")
        assert engine.adapter_bases == {"y": "base"} and len(loader.calls) == 1  # x went, the base stayed
        await reg.close()

    asyncio.run(main())


def test_an_idle_base_is_evicted_with_its_idle_adapters(engine, tmp_path, tiny):
    reg, loader = make_registry(engine, tmp_path, tiny, max_loaded_models=1)

    async def main():
        await reg.load("x")
        async with reg.use("x"):
            reg.residency.room_wait_timeout_s = 0.3
            with pytest.raises(Exception, match="busy models holding the rest stayed busy"):
                await reg.load("other")  # x runs: its base is not evicted
        await reg.load("other")
        assert loaded_names(engine) == {"other"} and engine.adapter_bases == {}
        assert [e.name for e in reg.loaded()] == ["other"]
        await reg.close()

    asyncio.run(main())
