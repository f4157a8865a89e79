"""Many models in one process: a real Engine and Registry loading real files under one memory budget.

Three models: the SmolLM2 GGUF, the same weights written as a sharded safetensors folder,
and a small random-weight Llama. Answers are greedy and compared token for token with the
offline API on the same model (conftest `llm` for SmolLM2 and its copy, LLM(folder) for
the random one). The registry is driven directly on an asyncio loop; HTTP is not needed
for what it decides.
"""

import asyncio
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.error

import pytest

from gpushare import LLM
from gpushare.api.streaming import EngineStream, checked_request
from gpushare.settings.settings import ModelEntry, Settings
from gpushare.engine.engine import Engine, EngineConfig
from gpushare.residency.memory_budget import count_tensors, estimate_weight_bytes
from gpushare.residency.registry import ModelLoadError, ModelNotFound, Registry, RegistrationError
from gpushare.protocol.sampling_params import SamplingParams
from gpushare.engine.local_device import LocalDevice
from tests.daemon_fixture import GPUSHARE, http, spawn_daemon, wait_for
from tests.model_files import gguf_to_hf_folder, random_llama_folder

SMOL, COPY, TINY = "smollm2:135m", "smollm2-st", "tiny-random"
PROMPTS = ["What is the capital of France?", "Name three colours."]
KV_BUDGET = 24 << 20  # the engine's KV pool, shared by the loaded models: room for short chats
GREEDY_TOKENS = 8


@pytest.fixture(scope="module")
def folders(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("multimodel")
    return {SMOL: smollm2_path, COPY: gguf_to_hf_folder(smollm2_path, str(root / "smollm2-st")),
            TINY: random_llama_folder(smollm2_path, str(root / "tiny-random"))}


@pytest.fixture(scope="module")
def oracles(folders, request):
    """The offline API on each model; SmolLM2 and its safetensors copy share the session's `llm`."""
    llm = request.getfixturevalue("llm")
    tiny = LLM(folders[TINY], dtype="float32", kv_dtype="float32", num_threads=2)
    yield {SMOL: llm, COPY: llm, TINY: tiny}
    tiny.shutdown()


@pytest.fixture
def engine():
    e = Engine(EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, kv_dtype="float32", kv_cache_bytes=KV_BUDGET))
    e.start()
    yield e
    e.shutdown()


def size_bytes(path: str) -> int:
    """A model's weights, as the registry counts it (the estimate is exact here); the KV pool counts once."""
    return estimate_weight_bytes(count_tensors(path), "float32")


def make_registry(engine, folders, budget_bytes, tmp_path, host_cache_bytes=4 << 30, **entry_options) -> Registry:
    models = [ModelEntry(name, path, **entry_options.get(name, {})) for name, path in folders.items()]
    settings = Settings(models=models, models_dir=tmp_path / "models")
    settings.memory.budget_bytes = budget_bytes
    settings.memory.kv_budget_bytes = KV_BUDGET
    settings.memory.max_loaded_models = 3
    settings.memory.host_cache_bytes = host_cache_bytes
    settings.engine.max_num_seqs = engine.config.max_num_seqs
    settings.engine.weights = "float32"  # the GGUF and its safetensors copy load alike (and as the oracle)
    settings.server.max_queued = 8
    return Registry({"cpu": LocalDevice(engine)}, settings, dtype="float32")


def messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def expected_ids(oracle, prompt: str, params: SamplingParams) -> list[int]:
    return oracle.chat(messages(prompt), params)[0].token_ids


async def chat(reg: Registry, name: str, prompt: str, params: SamplingParams, started: asyncio.Event | None = None,
               hold: asyncio.Event | None = None):
    """One request as the API makes it: a lease, then the engine stream. Returns (token ids, lease).
    `started` is set at the first output; with `hold`, the lease is kept after the stream ended until
    `hold` is set, so the model stays busy to the registry for exactly as long as a test needs (no
    hoping that a request outlives what happens meanwhile)."""
    async with reg.use(name) as lease:
        model = lease.model
        prompt_ids = model.tokenizer.encode(model.render_chat(messages(prompt)), add_special_tokens=False)
        ids = []
        with EngineStream(lease.device, checked_request(lease, prompt_ids, params, "default", None)) as stream:
            async for out in stream:
                assert out.finish_reason not in ("abort", "error"), f"{name}: {out.error}"
                ids += out.token_ids
                if started is not None:
                    started.set()
        if hold is not None:
            await hold.wait()
        return ids, lease


async def until(predicate, timeout_s: float = 60) -> None:
    """Let the event loop run until predicate() holds (registry state changes only on this loop)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


class BudgetWatch:
    """Samples what the engine really holds (its KV pool + its workers' weights) every few ms."""

    def __init__(self, engine):
        self.engine, self.peak_bytes = engine, 0

    async def run(self):
        while True:
            held = self.engine.kv_pool.capacity_bytes + sum(w.loaded.weight_bytes for w in list(self.engine.models.values()))
            self.peak_bytes = max(self.peak_bytes, held)
            await asyncio.sleep(0.005)


def test_three_models_alternate_under_a_budget_for_two(engine, folders, oracles, tmp_path):
    sizes = {name: size_bytes(path) for name, path in folders.items()}
    assert sizes[SMOL] == sizes[COPY] > 10 * sizes[TINY]
    budget = KV_BUDGET + sizes[SMOL] + sizes[COPY] + sizes[TINY] // 2  # any two fit, never all three
    reg = make_registry(engine, folders, budget, tmp_path)
    greedy = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS)
    long_params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    # The offline answers first: computing them would stall the event loop the registry runs on.
    answers = {(id(oracles[n]), p): expected_ids(oracles[n], p, greedy) for n in (SMOL, TINY) for p in PROMPTS}
    expected = {(name, prompt): answers[id(oracles[name]), prompt] for name in folders for prompt in PROMPTS}
    expected_long = expected_ids(oracles[TINY], PROMPTS[0], long_params)
    loads: dict[str, list[tuple[float, bool]]] = {name: [] for name in folders}
    watch = BudgetWatch(engine)

    async def main():
        watcher = asyncio.create_task(watch.run())
        recent: list[str] = []  # the loaded models as LRU predicts them, least recently used first
        for turn, name in enumerate([SMOL, COPY, TINY] * 3):
            prompt = PROMPTS[turn % 2]
            ids, lease = await chat(reg, name, prompt, greedy)
            assert ids == expected[name, prompt], (turn, name)
            if lease.load_duration_s > 0:
                loads[name].append((lease.load_duration_s, lease.entry.warm_load))
            recent = [n for n in recent if n != name] + [name]
            del recent[:-2]
            assert {e.name for e in reg.loaded()} == set(recent), turn

        # A busy model is never evicted, even as the least recently used: TINY runs a long
        # request (held busy until released), COPY is used after it, so loading SMOL must evict COPY.
        assert {e.name for e in reg.loaded()} == {COPY, TINY}
        started, release_tiny = asyncio.Event(), asyncio.Event()
        long_run = asyncio.create_task(chat(reg, TINY, PROMPTS[0], long_params, started, release_tiny))
        await started.wait()
        assert (await chat(reg, COPY, PROMPTS[1], greedy))[0] == expected[COPY, PROMPTS[1]]
        assert reg.get_loaded(TINY).last_used < reg.get_loaded(COPY).last_used
        assert (await chat(reg, SMOL, PROMPTS[1], greedy))[0] == expected[SMOL, PROMPTS[1]]
        assert {e.name for e in reg.loaded()} == {TINY, SMOL}

        # Both loaded models busy: a request for the third waits (no error, no overcommit)
        # until one of them is idle, then evicts that one.
        smol_started, release_smol = asyncio.Event(), asyncio.Event()
        smol_run = asyncio.create_task(chat(reg, SMOL, PROMPTS[0], greedy, smol_started, release_smol))
        await smol_started.wait()
        assert all(e.active for e in reg.loaded())
        copy_started = asyncio.Event()
        copy_run = asyncio.create_task(chat(reg, COPY, PROMPTS[0], greedy, copy_started))
        await until(lambda: [j.source.name for j in reg.loading()] == [COPY])  # it waits for room
        assert {e.name for e in reg.loaded()} == {TINY, SMOL} and not copy_started.is_set()
        release_smol.set()
        await copy_started.wait()
        assert smol_run.done() and not long_run.done()  # it loaded once SMOL was idle, evicting SMOL
        assert {e.name for e in reg.loaded()} == {TINY, COPY}
        release_tiny.set()
        assert (await copy_run)[0] == expected[COPY, PROMPTS[0]]
        assert (await smol_run)[0] == expected[SMOL, PROMPTS[0]]
        assert (await long_run)[0] == expected_long
        watcher.cancel()
        await reg.close()

    asyncio.run(main())
    assert watch.peak_bytes <= budget
    for name, times in loads.items():
        cold = [s for s, warm in times if not warm]
        warm = [s for s, warm in times if warm]
        print(f"{name}: cold load {cold[0]:.3f}s, warm reloads {', '.join(f'{s:.3f}s' for s in warm)}")
        assert len(cold) == 1 and len(warm) == 2, (name, times)  # read from its file once, then warm
        assert max(warm) * 5 < cold[0], (name, times)


def test_two_busy_models_share_engine_steps(engine, folders, tmp_path):
    """Steady load on two models: of the engine steps taken while both had work (40 or more, counted
    by the engine's step hook), each model gets at least 40%."""
    reg = make_registry(engine, {COPY: folders[COPY], TINY: folders[TINY]}, 4 << 30, tmp_path)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    shared_steps = {COPY: 0, TINY: 0}  # steps each model took while the other had work too
    last = {"steps": {COPY: 0, TINY: 0}, "both_busy": False}
    enough = threading.Event()

    def count(eng):  # the engine thread, after every step
        steps = {n: eng.models[n].steps if n in eng.models else 0 for n in shared_steps}
        if last["both_busy"]:  # both had work when this step's model was picked
            for n in shared_steps:
                shared_steps[n] += steps[n] - last["steps"][n]
        last["steps"] = steps
        last["both_busy"] = all(eng.has_work(n) for n in shared_steps)
        if sum(shared_steps.values()) >= 40:
            enough.set()

    async def client(name: str, stop: asyncio.Event):
        while not stop.is_set():
            await chat(reg, name, PROMPTS[0], params)

    async def main():
        await reg.load(COPY)
        await reg.load(TINY)
        engine.on_step = count
        stop = asyncio.Event()
        clients = [asyncio.create_task(client(name, stop)) for name in (COPY, TINY) for _ in range(2)]
        assert await asyncio.to_thread(enough.wait, 120), shared_steps
        stop.set()
        await asyncio.gather(*clients)
        engine.on_step = None
        await reg.close()
        return dict(shared_steps)

    steps = asyncio.run(main())
    total = sum(steps.values())
    print(f"engine steps while both models had work: {steps}")
    assert all(n >= 0.4 * total for n in steps.values()), steps


def test_a_corrupt_file_fails_clearly_while_another_model_streams(engine, folders, oracles, tmp_path):
    broken_gguf = tmp_path / "broken.gguf"
    with open(folders[SMOL], "rb") as f:
        broken_gguf.write_bytes(f.read(1 << 20))  # the header is cut short
    broken_folder = tmp_path / "broken-st"
    shutil.copytree(folders[TINY], broken_folder)
    weights = broken_folder / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)  # the header is whole, the tensors are not
    models = {TINY: folders[TINY], "broken-gguf": str(broken_gguf), "broken-st": str(broken_folder),
              SMOL: folders[SMOL]}
    budget = KV_BUDGET + size_bytes(folders[TINY]) * 3  # SMOL can never fit
    reg = make_registry(engine, models, budget, tmp_path)
    long_params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        started, release = asyncio.Event(), asyncio.Event()
        streaming = asyncio.create_task(chat(reg, TINY, PROMPTS[1], long_params, started, release))
        await started.wait()
        used = reg.used_bytes()
        with pytest.raises(ModelLoadError, match=r'failed to load model "broken-gguf": .*broken.gguf: corrupt or '
                                                 r"truncated GGUF file"):
            await reg.load("broken-gguf")
        with pytest.raises(ModelLoadError, match=r'failed to load model "broken-st": .*corrupt safetensors file'):
            await reg.load("broken-st")
        with pytest.raises(ModelLoadError, match=r'failed to load model "smollm2:135m": not enough memory on '
                                                 r"device cpu: it needs \d+ bytes"):
            await reg.load(SMOL)
        assert reg.used_bytes() == used and {e.name for e in reg.loaded()} == {TINY}  # nothing left behind
        assert set(engine.stats().models) == {TINY}
        release.set()
        ids, _ = await streaming
        await reg.close()
        return ids

    assert asyncio.run(main()) == expected_ids(oracles[TINY], PROMPTS[1], long_params)


def test_pinned_weight_and_live_settings(engine, folders, tmp_path):
    """Pinned models stay (keep_alive, eviction, unload); weight reaches the engine; apply_settings
    retires a removed model once its request ends."""
    models = {"pinned": folders[TINY], "other": folders[TINY], "third": folders[TINY]}
    budget = KV_BUDGET + size_bytes(folders[TINY]) * 2 + 1  # two at once
    reg = make_registry(engine, models, budget, tmp_path, pinned={"pinned": True, "weight": 3.0})

    async def main():
        await reg.preload()  # pinned implies preload
        assert reg.get_loaded("pinned").expires_at is None
        await reg.load("pinned", keep_alive_s=0)  # a request's keep_alive does not unload it
        await reg.load("other")
        await reg.load("third")  # evicts "other", though "pinned" was used less recently
        assert {e.name for e in reg.loaded()} == {"pinned", "third"}
        assert engine.models["pinned"].share_weight == 3.0 and engine.models["third"].share_weight == 1.0
        with pytest.raises(RegistrationError, match="pinned"):
            await reg.unload("pinned")

        new = make_registry(engine, {"pinned": folders[TINY], "other": folders[TINY]}, budget, tmp_path).settings
        async with reg.use("third") as lease:
            reg.apply_settings(new)  # "third" is gone from the config while its request runs
            assert reg.get_loaded("third") is lease.entry
            with pytest.raises(ModelNotFound):
                reg.find("third")
        await until(lambda: {e.name for e in reg.loaded()} == {"pinned"})  # "third" retired once its request ended
        # "pinned" is no longer pinned by the new config: its keep_alive timer runs
        assert reg.get_loaded("pinned").expires_at is not None
        await reg.close()

    asyncio.run(main())


def test_live_daemon_ps_tags_and_cli_load_progress(folders, tmp_path):
    """`gpushare load` draws the streamed progress of a cold load while /api/ps shows the fraction;
    /api/tags and `gpushare list` tell loaded, warm and on-disk models apart; a reload is warm."""
    # SmolLM2 in float32: its slowest load (every block dequantized), seconds long, for a bar of several
    # lines; as int4 (auto) the load can end within two of the CLI's 0.1 s progress lines
    models = [{"name": TINY, "path": folders[TINY], "pinned": True}, {"name": COPY, "path": folders[COPY]},
              {"name": SMOL, "path": folders[SMOL], "weights": "float32"}]
    daemon = spawn_daemon(tmp_path, folders[SMOL], {"models": models, "memory": {"kv_budget": "24MiB"}})
    try:
        def loaded():
            if daemon.proc.poll() is not None:
                raise RuntimeError(f"gpushare serve exited:\n{daemon.log()}")
            try:
                return daemon.loaded()
            except (urllib.error.URLError, ConnectionError):
                return {}

        assert wait_for(lambda: TINY in loaded(), timeout_s=120), daemon.log()  # pinned: loaded at start
        assert http("GET", daemon.url + "/api/ps")[1]["loading"] == []
        cli = subprocess.Popen([str(GPUSHARE), "load", SMOL], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=daemon.env())
        seen = []  # /api/ps "loading" rows of SMOL
        while cli.poll() is None:
            rows = http("GET", daemon.url + "/api/ps")[1]["loading"]
            seen += [(row["state"], row["load_progress"]) for row in rows if row["name"] == SMOL]
            time.sleep(0.02)
        out, err = cli.communicate()
        assert cli.returncode == 0 and out.strip() == f"loaded {SMOL}", err
        percents = re.findall(r"loading smollm2:135m +(\d+)% \[", err)
        assert len(set(percents)) >= 3 and percents[-1] == "100", err  # a bar, line by line when not a tty
        assert "loaded from disk in" in err
        progress = [p for state, p in seen if state == "loading"]
        assert any(0 < p < 1 for p in progress) and progress == sorted(progress), seen

        def states():
            return {m["name"]: m["state"] for m in http("GET", daemon.url + "/api/tags")[1]["models"]}

        assert states() == {TINY: "loaded", SMOL: "loaded", COPY: "on disk"}
        r = subprocess.run([str(GPUSHARE), "unload", SMOL], capture_output=True, text=True, env=daemon.env())
        assert r.returncode == 0, r.stderr
        assert wait_for(lambda: states()[SMOL] == "warm"), states()
        r = subprocess.run([str(GPUSHARE), "list"], capture_output=True, text=True, env=daemon.env())
        rows = {line.split()[0]: line.split()[-1] for line in r.stdout.splitlines()[1:]}
        assert r.stdout.split()[:6] == ["NAME", "ID", "SIZE", "MODIFIED", "KIND", "STATE"]
        assert rows == {TINY: "loaded", SMOL: "warm", COPY: "disk"}  # "on disk": the last word

        r = subprocess.run([str(GPUSHARE), "load", SMOL], capture_output=True, text=True, env=daemon.env())
        assert r.returncode == 0 and "loaded from the warm tier in" in r.stderr, r.stderr
        ps = loaded()
        assert ps[SMOL]["warm_load"] and ps[SMOL]["load_duration"] < 1e9
        assert ps[TINY]["pinned"] and ps[TINY]["kv_blocks_total"] > 0 and ps[TINY]["running"] == 0
        r = subprocess.run([str(GPUSHARE), "ps"], capture_output=True, text=True, env=daemon.env())
        header, *lines = r.stdout.splitlines()
        assert header.split() == ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL", "KV", "BLOCKS", "RUN/QUEUED",
                                  "DEVICE", "WORKER", "PID", "KIND", "WEIGHTS", "BASE"]
        tiny_line = next(line for line in lines if line.startswith(TINY))
        assert "100% CPU" in tiny_line and "Forever" in tiny_line and f"0/{ps[TINY]['kv_blocks_total']}" in tiny_line
        words = tiny_line.split()  # ... DEVICE, WORKER PID, KIND, then WEIGHTS (a format and its kernel)
        assert words[words.index("cpu"):words.index("cpu") + 3] == ["cpu", str(ps[TINY]["worker_pid"]), "chat"]
        assert words[-2] == ps[TINY]["weights"]
        r = subprocess.run([str(GPUSHARE), "unload", TINY], capture_output=True, text=True, env=daemon.env())
        assert r.returncode == 1 and "is pinned" in r.stderr
    finally:
        daemon.stop()


def test_warm_tier_holds_host_cache_bytes_least_recently_unloaded_out_first(engine, folders, tmp_path):
    copy = shutil.copytree(folders[TINY], tmp_path / "tiny-copy")
    weight_bytes = estimate_weight_bytes(count_tensors(folders[TINY]), "float32")
    models = {"t1": folders[TINY], "t2": str(copy)}
    reg = make_registry(engine, models, 4 << 30, tmp_path, host_cache_bytes=weight_bytes * 3 // 2)  # room for one

    async def main():
        await reg.load("t1")
        await reg.load("t2")
        await reg.unload("t1")
        assert reg.state(reg.find("t1")) == "warm"
        await reg.unload("t2")
        assert [reg.state(reg.find(n)) for n in ("t1", "t2")] == ["on disk", "warm"]
        assert (await reg.load("t2")).entry.warm_load and not (await reg.load("t1")).entry.warm_load
        reg.settings.memory.host_cache_bytes = 0
        reg.apply_settings(reg.settings)  # 0 turns the warm tier off
        await reg.unload("t1")
        assert reg.state(reg.find("t1")) == "on disk"
        await reg.close()

    asyncio.run(main())
