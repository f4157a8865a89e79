"""One engine worker process per device (engine.devices): two CPU devices with a model pinned to
each, on the real SmolLM2 GGUF through a live daemon on loopback; and the worker specs the daemon
makes for GPU and MIG nodes, from NVML fakes and sysfs trees built from real captures."""

import json
import os
import signal
import sys
import threading
import time
import urllib.error
from http.client import HTTPConnection
from pathlib import Path

import pytest

from daemon_fixture import http, serving, wait_for
from test_oracle import NEW_TOKENS, conversations

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "node"))
from node_fakes import FakeNvml, a100_7x1g, h100_node_gpus, h100_with_mig, sysfs_root  # noqa: E402

A, B, R = "smol-a", "smol-b", "smol-r"
RESTART_WITHIN_S = 60

needs_two_cpus = pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1")


@pytest.fixture(scope="module")
def two_devices(tmp_path_factory, smollm2_path):
    # float32 weights: the exact path, as the oracle runs
    overrides = {"engine": {"devices": ["cpu:0", "cpu:1"], "weights": "float32", "max_num_seqs": 4,
                            "max_num_batched_tokens": 512},
                 "models": [{"name": A, "path": smollm2_path, "device": "cpu:0", "preload": True},
                            {"name": B, "path": smollm2_path, "device": "cpu:1", "preload": True},
                            {"name": R, "path": smollm2_path, "replicas": 2}]}
    with serving(tmp_path_factory.mktemp("devices"), smollm2_path, overrides) as daemon:
        yield daemon


def chat_text(daemon, model: str, index: int) -> str:
    status, body, _ = http("POST", daemon.url + "/v1/chat/completions",
                           {"model": model, "messages": conversations()[index], "temperature": 0,
                            "max_tokens": NEW_TOKENS})
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def expected_text(llm, oracle_outputs, index: int) -> str:
    return llm.tokenizer.decode([t for t in oracle_outputs[index] if t not in llm.model.stop_token_ids])


def devices_of(daemon) -> dict[str, dict]:
    return {d["device"]: d for d in http("GET", daemon.url + "/health")[1]["devices"]}


def open_stream(daemon, model: str, body: dict) -> tuple[HTTPConnection, object, str]:
    """A streamed Ollama chat whose first chunk has been read: (connection, response, that chunk's text)."""
    conn = HTTPConnection("127.0.0.1", int(daemon.host.split(":")[1]), timeout=120)
    conn.request("POST", "/api/chat", json.dumps({"model": model, **body}))
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    first = json.loads(resp.readline())
    assert first["done"] is False
    return conn, resp, first["message"]["content"]


def load(daemon, model: str) -> int:
    """Load `model` (Ollama's empty generate) and return its worker's pid."""
    status, body, _ = http("POST", daemon.url + "/api/generate", {"model": model})
    assert status == 200, body
    return daemon.loaded()[model]["worker_pid"]


@needs_two_cpus
def test_each_model_runs_on_its_own_device_and_worker(two_devices):
    ps = two_devices.loaded()
    assert {name: m["device"] for name, m in ps.items()} == {A: "cpu:0", B: "cpu:1"}
    pids = {ps[A]["worker_pid"], ps[B]["worker_pid"]}
    assert len(pids) == 2 and two_devices.proc.pid not in pids
    assert all(m["size_vram"] == 0 and m["device_healthy"] for m in ps.values())
    assert {d: (row["healthy"], row["worker_pid"]) for d, row in devices_of(two_devices).items()} == {
        "cpu:0": (True, ps[A]["worker_pid"]), "cpu:1": (True, ps[B]["worker_pid"])}
    for pid in pids:  # the workers' OpenMP threads spin briefly (worker_client.openmp_defaults)
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert b"GOMP_SPINCOUNT=1000" in f.read().split(b"\0")
    status, metrics, _ = http("GET", two_devices.url + "/metrics")
    assert status == 200
    for device in ("cpu:0", "cpu:1"):
        assert f'gpushare_device_healthy{{device="{device}"}} 1.0' in metrics
        assert f'gpushare_device_models_loaded{{device="{device}"}} 1.0' in metrics


@needs_two_cpus
def test_both_devices_answer_exactly_as_the_oracle_at_once(two_devices, llm, oracle_outputs):
    answers: dict = {}

    def ask(model: str, index: int) -> None:
        answers[(model, index)] = chat_text(two_devices, model, index)

    threads = [threading.Thread(target=ask, args=(model, i)) for i in range(4) for model in (A, B)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert answers == {(model, i): expected_text(llm, oracle_outputs, i) for i in range(4) for model in (A, B)}


@needs_two_cpus
def test_a_model_with_two_replicas_is_on_both_devices_and_answers_alike(two_devices, llm, oracle_outputs):
    assert chat_text(two_devices, R, 0) == expected_text(llm, oracle_outputs, 0)  # loads the first copy
    assert wait_for(lambda: len([m for m in ps_rows(two_devices) if m["name"] == R]) == 2, 60)
    copies = [m for m in ps_rows(two_devices) if m["name"] == R]
    assert {m["device"] for m in copies} == {"cpu:0", "cpu:1"}
    answers = {}
    threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, chat_text(two_devices, R, i)))
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert answers == {i: expected_text(llm, oracle_outputs, i) for i in range(4)}
    assert all(m["device"] in ("cpu:0", "cpu:1") for m in ps_rows(two_devices))
    status, _, _ = http("POST", two_devices.url + "/api/generate", {"model": R, "keep_alive": 0})
    assert status == 200 and wait_for(lambda: R not in {m["name"] for m in ps_rows(two_devices)}, 30)


def ps_rows(daemon) -> list[dict]:
    return http("GET", daemon.url + "/api/ps")[1]["models"]


@needs_two_cpus
def test_a_killed_worker_fails_only_its_streams_and_comes_back(two_devices, llm, oracle_outputs):
    killed_pid = load(two_devices, A)
    doomed, doomed_resp, _ = open_stream(two_devices, A, {"messages": conversations()[0],
                                                          "options": {"temperature": 0, "num_predict": 2000}})
    survivor, survivor_resp, first_chunk_text = open_stream(
        two_devices, B, {"messages": conversations()[1], "options": {"temperature": 0, "num_predict": NEW_TOKENS}})
    os.kill(killed_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    lines = [json.loads(line) for line in doomed_resp.read().splitlines() if line.strip()]
    assert time.monotonic() - killed_at < 10
    assert "error" in lines[-1] and f"pid {killed_pid}) killed by signal SIGKILL" in lines[-1]["error"]
    doomed.close()

    rest = [json.loads(line) for line in survivor_resp.read().splitlines() if line.strip()]
    survivor.close()
    assert rest[-1]["done"] is True and "error" not in rest[-1]
    streamed = first_chunk_text + "".join(c["message"]["content"] for c in rest)
    assert streamed == expected_text(llm, oracle_outputs, 1)

    status, health, _ = http("GET", two_devices.url + "/health")
    assert status == 200 and health["status"] == "ok"
    assert wait_for(lambda: devices_of(two_devices)["cpu:0"]["healthy"]
                    and devices_of(two_devices)["cpu:0"]["worker_pid"] not in (None, killed_pid), RESTART_WITHIN_S)
    back = devices_of(two_devices)["cpu:0"]
    assert back["restarts"] == 1
    assert chat_text(two_devices, A, 2) == expected_text(llm, oracle_outputs, 2)  # reloaded on demand
    assert two_devices.loaded()[A]["worker_pid"] == back["worker_pid"]


@needs_two_cpus
def test_a_request_in_flight_when_its_worker_dies_is_a_503_with_retry_after(two_devices):
    pid = load(two_devices, A)
    result = {}

    def ask():
        try:
            result["reply"] = http("POST", two_devices.url + "/v1/completions",
                                   {"model": A, "prompt": "Tell me a long story.", "temperature": 0,
                                    "max_tokens": 2000, "ignore_eos": True})
        except urllib.error.URLError as e:
            result["reply"] = e

    thread = threading.Thread(target=ask)
    thread.start()
    assert wait_for(lambda: two_devices.loaded()[A]["running"] == 1, 60)
    os.kill(pid, signal.SIGKILL)
    thread.join(60)
    status, body, headers = result["reply"]
    assert status == 503 and "killed by signal SIGKILL" in body["error"]["message"]
    assert headers["Retry-After"] == "1"
    assert wait_for(lambda: devices_of(two_devices)["cpu:0"]["healthy"], RESTART_WITHIN_S)


def test_a_device_outside_the_process_affinity_is_a_config_error(tmp_path, smollm2_path):
    from gpushare.settings.settings import ConfigError, parse_settings
    from gpushare.daemon.serve import check_kv_dtype

    outside = max(os.sched_getaffinity(0)) + 1
    settings = parse_settings({"models": [], "engine": {"devices": [f"cpu:{outside}"]}}, env={})
    with pytest.raises(ConfigError, match=f"cpu:{outside}"):
        check_kv_dtype(settings)  # what `gpushare serve` runs before it starts anything


def test_engine_isolation_thread_serves_from_an_engine_in_the_daemon(tmp_path, smollm2_path, llm, oracle_outputs):
    overrides = {"engine": {"isolation": "thread", "weights": "float32", "max_num_seqs": 4,
                            "max_num_batched_tokens": 512}}
    with serving(tmp_path, smollm2_path, overrides) as daemon:
        model = next(iter(daemon.loaded()))
        assert chat_text(daemon, model, 0) == expected_text(llm, oracle_outputs, 0)
        (device,) = devices_of(daemon).values()
        assert device["worker_pid"] is None and daemon.loaded()[model]["worker_pid"] is None


# ---- GPU and MIG nodes: the worker specs the daemon makes (no GPU needed) ------------------------

def plan_for(report_gpus, tree: str, devices=None, node=None):
    from gpushare.node.devices import plan_workers
    from gpushare.node.gpu import read_gpus
    from gpushare.node.topology import read_topology

    return plan_workers(devices, read_gpus(FakeNvml(report_gpus)), read_topology(sysfs_root(tree)), node)


def test_an_eight_gpu_node_gets_one_worker_per_gpu_with_its_uuid_and_local_cpus():
    from gpushare.settings.settings import parse_settings
    from gpushare.daemon.serve import worker_clients

    settings = parse_settings({"models": [], "memory": {"kv_budget": "1GiB"}}, env={})
    plans = plan_for(h100_node_gpus(), "xeon-2s-8xh100")
    clients = worker_clients(settings, plans)
    assert list(clients) == [f"cuda:{i}" for i in range(8)]
    for i, (client, gpu) in enumerate(zip(clients.values(), h100_node_gpus())):
        assert client.env == {"CUDA_VISIBLE_DEVICES": gpu.uuid}
        assert client.config.device == "cuda"
        assert client.config.cpus == [2 * i, 2 * i + 1] and client.config.num_threads == 2
        assert client.config.kv_cache_bytes == 1 << 30 and client.kv_pool_bytes == 1 << 30


def test_a_mig_gpu_gets_one_worker_per_instance_and_mps_clients_their_pipes():
    from gpushare.settings.settings import parse_settings
    from gpushare.daemon.serve import worker_clients
    from gpushare.node.node_settings import parse_node_settings

    node = parse_node_settings({"mps": {"enabled": True}})
    settings = parse_settings({"models": []}, env={})
    clients = worker_clients(settings, plan_for([a100_7x1g()], "xeon-2s-4xh100", node=node))
    assert len(clients) == 7
    for name, client in clients.items():
        assert name.startswith("MIG-") and client.env["CUDA_VISIBLE_DEVICES"] == name
        assert client.env["CUDA_MPS_PIPE_DIRECTORY"].startswith("/run/gpushare/mps/")
        assert client.env["CUDA_MPS_PIPE_DIRECTORY"].endswith("/pipe")
        assert client.config.device == "cuda" and client.config.cpus
    assert len({tuple(c.config.cpus) for c in clients.values()}) == 7  # no two share CPUs


def test_thread_isolation_gives_each_gpu_engine_its_own_cuda_device():
    """One process sees the plan's GPUs in plan order (CUDA_VISIBLE_DEVICES by UUID), each engine its own
    index among them: NVML's cuda:2 and cuda:5 become the process's cuda:0 and cuda:1."""
    from gpushare.settings.settings import parse_settings
    from gpushare.daemon.serve import thread_engine_configs

    settings = parse_settings({"models": [], "engine": {"isolation": "thread"}}, env={})
    gpus = h100_node_gpus()
    configs, visible = thread_engine_configs(settings, plan_for(gpus, "xeon-2s-8xh100", ["cuda:2", "cuda:5", "cpu"]))
    assert {name: config.device for name, config in configs.items()} == {"cuda:2": "cuda:0", "cuda:5": "cuda:1",
                                                                         "cpu": "cpu"}
    assert visible == f"{gpus[2].uuid},{gpus[5].uuid}"


def test_thread_isolation_runs_one_mig_instance_and_refuses_two():
    """A CUDA process enumerates one MIG instance at most: alone it is the process's cuda:0; beside
    another GPU device, thread isolation is refused before anything starts."""
    from gpushare.settings.settings import ConfigError, parse_settings
    from gpushare.daemon.serve import thread_engine_configs

    settings = parse_settings({"models": [], "engine": {"isolation": "thread"}}, env={})
    mig = h100_with_mig()
    one = mig.migs[1].uuid
    configs, visible = thread_engine_configs(settings, plan_for([mig], "xeon-2s-4xh100", [one]))
    assert ({name: config.device for name, config in configs.items()}, visible) == ({one: "cuda:0"}, one)
    both = plan_for([mig], "xeon-2s-4xh100", [one, mig.migs[0].uuid])
    with pytest.raises(ConfigError, match=f"cannot run {one} beside {mig.migs[0].uuid}: a CUDA process sees one "
                                          "MIG instance at most; use engine.isolation: process"):
        thread_engine_configs(settings, both)


def test_a_gpu_nodes_default_budget_is_each_devices_free_memory_less_the_margin_as_nvml_reports_it():
    """The supervisor learns device memory from the worker plan (NVML), not from CUDA, which it never
    loads: memory another process holds is not in the budget, and memory.device_margin is kept free.
    On a 7-instance MIG A100 (nothing used) the budget is one instance's memory less the margin."""
    from gpushare.settings.settings import parse_settings
    from gpushare.daemon.serve import worker_clients
    from gpushare.residency.registry import Registry

    settings = parse_settings({"models": [], "memory": {"device_margin": "256MiB"}}, env={})
    plans = plan_for([a100_7x1g()], "xeon-2s-4xh100")
    assert set(plans.memory_free_bytes().values()) == {4864 << 20} and len(plans.memory_free_bytes()) == 7
    registry = Registry(worker_clients(settings, plans), settings, dtype="bfloat16",
                        memory_free_bytes=plans.memory_free_bytes())
    assert registry.residency.budget_bytes == (4864 - 256) << 20

    gpus = h100_node_gpus()[:4]
    gpus[2].memory_used_mib = 60_000  # another process's model on one of them
    plans = plan_for(gpus, "xeon-2s-4xh100", devices=["cuda:2"])
    registry = Registry(worker_clients(settings, plans), settings, dtype="bfloat16",
                        memory_free_bytes=plans.memory_free_bytes())
    assert registry.residency.budget_bytes == (81559 - 60_000 - 256) << 20


def test_a_worker_sends_one_message_per_burst_of_outputs_and_only_its_newest_snapshot():
    from gpushare.protocol import messages as m
    from gpushare.protocol.engine_stats import EngineSnapshot, EngineStats
    from gpushare.protocol.outputs import RequestOutput
    from gpushare.engine.worker import coalesce

    def out(rid: str) -> m.Outputs:
        return m.Outputs([(rid, RequestOutput(rid, "x", [1], False))])

    def snap(steps: int) -> m.Snapshot:
        return m.Snapshot(EngineSnapshot(EngineStats(steps), {}, 0.0, None))

    reply = m.Reply(7, "done")
    sent = coalesce([out("a"), out("b"), snap(1), snap(2), reply, out("c"), snap(3)])
    assert [type(x).__name__ for x in sent] == ["Outputs", "Snapshot", "Reply", "Outputs", "Snapshot"]
    assert [rid for rid, _ in sent[0].items] == ["a", "b"]
    assert sent[1].snapshot.stats.steps == 2 and sent[4].snapshot.stats.steps == 3
