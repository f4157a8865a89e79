"""A tensor-parallel model through a live daemon on loopback: SmolLM2 with tensor_parallel: 2 over
the CPU devices cpu:0 and cpu:1 answers as the oracle does, alone and concurrently; ps shows its
group; a rank that dies takes the group down and the group comes back as one; a model its ranks
cannot split is a config error naming it."""

import json
import os
import signal
import subprocess
import threading
import time

import pytest
import yaml

from daemon_fixture import GPUSHARE, free_port, http, serving, wait_for
from test_devices import RESTART_WITHIN_S, devices_of, expected_text, needs_two_cpus, open_stream
from test_oracle import NEW_TOKENS, conversations

TP = "smol-tp"
GROUP = "cpu:0+cpu:1"


@pytest.fixture(scope="module")
def tp_daemon(tmp_path_factory, smollm2_path):
    overrides = {"engine": {"devices": ["cpu:0", "cpu:1"], "weights": "float32", "max_num_seqs": 8,
                            "max_num_batched_tokens": 512},
                 "models": [{"name": TP, "path": smollm2_path, "tensor_parallel": 2, "preload": True}]}
    with serving(tmp_path_factory.mktemp("tp"), smollm2_path, overrides) as daemon:
        yield daemon


def chat(daemon, index: int) -> str:
    status, body, _ = http("POST", daemon.url + "/v1/chat/completions",
                           {"model": TP, "messages": conversations()[index], "temperature": 0,
                            "max_tokens": NEW_TOKENS})
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


@needs_two_cpus
def test_a_tensor_parallel_model_answers_as_the_oracle_alone_and_concurrently(tp_daemon, llm, oracle_outputs):
    count = len(conversations())
    expected = [expected_text(llm, oracle_outputs, i) for i in range(count)]
    alone = [chat(tp_daemon, i) for i in range(count)]
    together: list = [None] * count
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, chat(tp_daemon, i))) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for answers in (alone, together):
        same = [a == e for a, e in zip(answers, expected)]
        assert sum(same) >= count - 1, same


@needs_two_cpus
def test_ps_shows_the_group(tp_daemon):
    entry = tp_daemon.loaded()[TP]
    assert entry["device"] == GROUP
    assert entry["tensor_parallel"] == 2 and entry["devices"] == ["cpu:0", "cpu:1"]
    assert entry["weights"] == "float32"
    out = subprocess.run([str(GPUSHARE), "ps"], capture_output=True, text=True, timeout=30, env=tp_daemon.env())
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith(TP))
    assert f"TP=2 {GROUP}" in row
    group = devices_of(tp_daemon)[GROUP]
    assert len(group["rank_pids"]) == 2 and group["rank_pids"][0] == group["worker_pid"]


@needs_two_cpus
def test_a_dead_rank_takes_its_group_down_and_the_group_restarts_as_one(tp_daemon, llm, oracle_outputs):
    before = devices_of(tp_daemon)[GROUP]
    leader_pid, follower_pid = before["rank_pids"]
    doomed, doomed_resp, _ = open_stream(tp_daemon, TP, {"messages": conversations()[0],
                                                         "options": {"temperature": 0, "num_predict": 2000}})
    os.kill(follower_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    lines = [json.loads(line) for line in doomed_resp.read().splitlines() if line.strip()]
    doomed.close()
    assert time.monotonic() - killed_at < 10
    assert "error" in lines[-1]  # the first rank's step failed, or the group was stopped: either way it says so
    assert wait_for(lambda: subprocess.run(["kill", "-0", str(leader_pid)], capture_output=True).returncode != 0, 10)
    assert wait_for(lambda: devices_of(tp_daemon)[GROUP]["healthy"]
                    and devices_of(tp_daemon)[GROUP]["restarts"] == before["restarts"] + 1, RESTART_WITHIN_S)
    back = devices_of(tp_daemon)[GROUP]
    assert set(back["rank_pids"]).isdisjoint({leader_pid, follower_pid})
    assert wait_for(lambda: TP in tp_daemon.loaded(), RESTART_WITHIN_S)  # preloaded again
    assert chat(tp_daemon, 2) == expected_text(llm, oracle_outputs, 2)


@needs_two_cpus
def test_a_reload_keeps_each_split_until_the_restart(tp_daemon, smollm2_path):
    """Groups are planned at start: a SIGHUP that changes a model's tensor_parallel, or adds a
    tensor-parallel model, keeps the running split and says it waits for the restart."""
    config_path = tp_daemon.log_path.parent / "gpushare.yaml"
    config = yaml.safe_load(config_path.read_text())
    config["models"] = [{**config["models"][0], "tensor_parallel": 1},
                        {"name": "later", "path": smollm2_path, "tensor_parallel": 2}]
    config_path.write_text(yaml.safe_dump(config))
    reloads = tp_daemon.log().count("config reloaded")
    tp_daemon.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: tp_daemon.log().count("config reloaded") > reloads, 30), tp_daemon.log()
    log = tp_daemon.log()
    assert f"models: {TP}'s tensor_parallel changed; it takes effect at the next restart" in log
    assert "models: later (a new tensor-parallel model) changed; it takes effect at the next restart" in log
    names = [m["name"] for m in http("GET", tp_daemon.url + "/api/tags")[1]["models"]]
    assert TP in names and "later" not in names
    assert tp_daemon.loaded()[TP]["tensor_parallel"] == 2


def test_a_model_its_ranks_cannot_split_is_a_config_error(tmp_path):
    folder = tmp_path / "odd"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 192,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 3, "num_key_value_heads": 1,
        "head_dim": 64, "max_position_embeddings": 256}))
    config = tmp_path / "gpushare.yaml"
    config.write_text(yaml.safe_dump({
        "server": {"host": f"127.0.0.1:{free_port()}"}, "engine": {"devices": ["cpu:0", "cpu:1"]},
        "models": [{"name": "odd", "path": str(folder), "tensor_parallel": 2}]}))
    out = subprocess.run([str(GPUSHARE), "serve", "--config", str(config)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert ("config error: models[0] odd: tensor_parallel 2 cannot split its 3 attention heads (1 KV heads)"
            in out.stderr), out.stderr


def test_a_gpu_group_rank_sees_its_group_in_rank_order_and_runs_on_its_own(tmp_path):
    """On the recorded 8xH100 node (NVML and sysfs fakes), a TP=4 group's ranks: NCCL reaches peers
    only among the GPUs a process sees, so each sees the group's four, and runs on the rank-th."""
    from test_devices import h100_node_gpus, plan_for

    from gpushare.settings.settings import parse_settings
    from gpushare.daemon.serve import engine_config
    from gpushare.daemon.groups import group_clients
    from gpushare.node.gpu_links import GpuLinks
    from gpushare.node.tp_groups import plan_tp_groups

    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    settings = parse_settings({"engine": {"devices": [f"cuda:{i}" for i in range(8)]},
                               "models": [{"name": "big", "path": str(model), "tensor_parallel": 4,
                                           "tensor_parallel_cross_numa": True}]}, env={})
    plans = plan_for(h100_node_gpus(), "xeon-2s-8xh100", devices=settings.engine.devices)
    groups = plan_tp_groups(settings.models, plans, GpuLinks())
    clients, model_groups = group_clients(settings, groups, lambda plan: engine_config(settings, plan))
    [(name, group)] = clients.items()
    assert model_groups == {"big": name} and group.world_size == 4
    uuids = [gpu.uuid for gpu in h100_node_gpus()]
    members = [int(m.split(":")[1]) for m in group.members]
    for rank, client in enumerate(group.ranks):
        assert client.env["CUDA_VISIBLE_DEVICES"] == ",".join(uuids[i] for i in members)
        assert client.config.device == f"cuda:{rank}"
        assert client.spec.group.rank == rank and client.spec.group.devices == group.members
