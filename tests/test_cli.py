"""The `gpushare` command, run as the installed console script against a live daemon.

Each subprocess pays Python + torch start-up, so every verb runs once as a real command;
the --json variants and argument handling run in-process through `cli.main`. The last
test stops the module's daemon with SIGTERM to check the drain.
"""

import json
import os
import signal
import subprocess
from http.client import HTTPConnection

import pytest
import torch
from daemon_fixture import GPUSHARE, MODEL, free_port, serving

from gpushare import SamplingParams
from gpushare.cli import main as cli


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_path):
    with serving(tmp_path_factory.mktemp("cli"), smollm2_path, {"server": {"drain_timeout": "2s"}}) as d:
        yield d


@pytest.fixture
def host_env(daemon, monkeypatch):
    """In-process CLI calls reach the module's daemon."""
    monkeypatch.setenv("GPUSHARE_HOST", daemon.host)


def gpushare(daemon, *args, input_text=None, timeout_s=180):
    env = daemon.env() if daemon is not None else {**os.environ, "GPUSHARE_HOST": f"127.0.0.1:{free_port()}"}
    stdin = None if input_text is not None else subprocess.DEVNULL
    return subprocess.run([str(GPUSHARE), *args], input=input_text, stdin=stdin, capture_output=True, text=True,
                          env=env, timeout=timeout_s)


def test_not_running_is_a_clear_error():
    r = gpushare(None, "ps")
    assert r.returncode == 1 and "could not connect to the gpushare daemon" in r.stderr
    assert "gpushare serve" in r.stderr


def test_every_verb_explains_itself(capsys):
    verbs = {"serve": "serve", "run": "run", "ps": "ps", "list": "list", "ls": "list", "show": "show",
             "load": "load", "unload": "unload", "stop": "unload", "create": "create", "rm": "rm"}
    for verb, canonical in verbs.items():
        with pytest.raises(SystemExit) as info:
            cli.main([verb, "--help"])
        assert info.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: gpushare {canonical}") and len(out.splitlines()) > 3, verb


@pytest.mark.parametrize("yaml_text, message", [
    ("engine: {max_num_seqs: -1}\n", "engine.max_num_seqs: must be a positive integer, got -1"),
    # engine.device auto is the CPU on a machine without a GPU, where float16 KV is refused
    pytest.param("engine: {kv_dtype: float16}\n", "config error: engine.kv_dtype: float16 is for GPUs",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="float16 KV is fine on a GPU")),
])
def test_serve_with_a_bad_config_names_the_key(tmp_path, yaml_text, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml_text)
    r = gpushare(None, "serve", "--config", str(bad))
    assert r.returncode == 1
    assert message in r.stderr


def test_list(daemon, host_env, capsys):
    r = gpushare(daemon, "list")
    assert r.returncode == 0, r.stderr
    header, row = r.stdout.splitlines()
    assert header.split() == ["NAME", "ID", "SIZE", "MODIFIED", "KIND", "STATE"] and row.startswith(MODEL)
    assert cli.main(["list", "--json"]) == 0
    assert [m["name"] for m in json.loads(capsys.readouterr().out)["models"]] == [MODEL]


def test_show(daemon, host_env, capsys):
    r = gpushare(daemon, "show", MODEL)
    assert r.returncode == 0, r.stderr
    assert "architecture        llama" in r.stdout and "context length      8192" in r.stdout
    assert "quantization        Q4_1" in r.stdout
    assert cli.main(["show", MODEL, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["details"]["parameter_size"] == "135M"
    assert cli.main(["show", "nope"]) == 1
    assert 'model "nope" not found' in capsys.readouterr().err


def test_run_with_a_prompt_answers_as_the_offline_llm(daemon, served_llm):
    expected = served_llm.chat([{"role": "user", "content": "Say hello"}], SamplingParams(temperature=0, max_tokens=8))[0]
    r = gpushare(daemon, "run", MODEL, "Say", "hello", "--temperature", "0", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected.text + "\n"


def test_run_format_json_answers_json(daemon):
    # as `ollama run --format json`: constrained decoding makes even this small model's answer JSON
    r = gpushare(daemon, "run", MODEL, "List two colours as JSON.", "--format", "json", "--temperature", "0",
                 "--max-tokens", "200")
    assert r.returncode == 0, r.stderr
    assert isinstance(json.loads(r.stdout), dict)


def test_run_reads_piped_stdin(daemon, served_llm):
    expected = served_llm.chat([{"role": "user", "content": "Summarise:\n\nThe cat sat on the mat.\n"}],
                        SamplingParams(temperature=0, max_tokens=8))[0]
    r = gpushare(daemon, "run", MODEL, "Summarise:", "--temperature", "0", "--max-tokens", "8",
                 input_text="The cat sat on the mat.\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected.text + "\n"


def test_interactive_run_keeps_the_conversation(daemon):
    primary, secondary = os.openpty()
    proc = subprocess.Popen([str(GPUSHARE), "run", MODEL, "--temperature", "0", "--max-tokens", "6", "--verbose"],
                            stdin=secondary, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=daemon.env())
    os.close(secondary)
    os.write(primary, b"My name is Ada.\nWhat is my name?\n/bye\n")
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        os.close(primary)
    assert proc.returncode == 0, err
    assert out.count(">>> ") == 3
    prompts = [int(line.split()[3]) for line in err.splitlines() if line.startswith("prompt eval count")]
    evals = [int(line.split()[2]) for line in err.splitlines() if line.startswith("eval count")]
    assert len(prompts) == 2 and prompts[1] > prompts[0] + evals[0]  # turn two carries turn one


def test_unload_load_and_ps(daemon, host_env, capsys):
    r = gpushare(daemon, "unload", MODEL)
    assert r.returncode == 0, r.stderr
    assert MODEL not in daemon.loaded()
    assert cli.main(["stop", MODEL]) == 1
    assert f'model "{MODEL}" is not loaded' in capsys.readouterr().err
    r = gpushare(daemon, "load", MODEL, "--keep-alive", "-1")
    assert r.returncode == 0 and r.stdout.strip() == f"loaded {MODEL}", r.stderr
    r = gpushare(daemon, "ps")
    assert r.returncode == 0, r.stderr
    header, row, memory_line = r.stdout.splitlines()
    assert header.split()[:6] == ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"] and "KV BLOCKS" in header
    assert row.startswith(MODEL) and "100% CPU" in row and "Forever" in row
    assert cli.main(["ps", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (m,) = data["models"]
    # the CPU engine's memory is the host's RAM, as its worker last reported it
    (device,) = data["memory"]["devices"]
    assert device["device"] == "cpu" and device["memory"] == "host"
    assert memory_line.startswith("cpu: host RAM ") and memory_line.endswith(" free") and " used, " in memory_line
    # CONTEXT: what one request can get, the trained 8192 capped by the model's KV pool
    assert row.split()[6] == str(min(8192, m["kv_blocks_total"] * m["kv_block_size"]))
    assert m["kv_blocks_used"] == 0 and m["kv_blocks_total"] > 0
    assert cli.main(["load", MODEL, "--keep-alive", "soon"]) == 1
    assert "--keep-alive: must be a duration" in capsys.readouterr().err


def test_create_and_rm(daemon, host_env, smollm2_path, capsys):
    r = gpushare(daemon, "create", "mine:q4", "--from", smollm2_path)
    assert r.returncode == 0, r.stderr
    assert os.path.islink(daemon.models_dir / "mine:q4.gguf")
    assert cli.main(["list", "--json"]) == 0
    assert {m["name"] for m in json.loads(capsys.readouterr().out)["models"]} == {MODEL, "mine:q4"}
    r = gpushare(daemon, "rm", "mine:q4")
    assert r.returncode == 0 and r.stdout.strip() == "deleted 'mine:q4'", r.stderr
    assert not (daemon.models_dir / "mine:q4.gguf").exists() and os.path.exists(smollm2_path)
    assert cli.main(["create", "bad", "--from", str(daemon.models_dir)]) == 1
    assert "neither a GGUF file" in capsys.readouterr().err
    assert cli.main(["rm", MODEL]) == 1
    assert "defined in the config file" in capsys.readouterr().err


# Greedy, the model ends its answer to this after a few tokens ("No." and the end of sequence).
EARLY_END = {"model": MODEL, "messages": [{"role": "user", "content": "Reply with one word: yes or no. Is water wet?"}],
             "temperature": 0, "max_tokens": 2000, "stream": True}


def sse_events(port: int, body: dict):
    """POST a streamed /v1/chat/completions; its JSON events, read as they come, up to `data: [DONE]`."""
    conn = HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(body))
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    for line in resp:
        if line.startswith(b"data: "):
            if line.strip() == b"data: [DONE]":
                return
            yield json.loads(line[len(b"data: "):])


def test_sigterm_drains_then_ends_open_streams_with_an_error(daemon):
    """Last: stops the module's daemon. A stream that ended before SIGTERM ended normally; one open at
    SIGTERM runs on for drain_timeout (2 s), then ends with an error object; the daemon exits 0.

    The open stream's length is guaranteed, not left to the model: the same greedy prompt that ends
    after a few tokens on its own (the first stream) runs with `ignore_eos` up to 2,000 tokens, far
    past the drain on any device. (A sampled "long story" once ended early, before the signal.)"""
    port = int(daemon.host.split(":")[1])
    ended = list(sse_events(port, EARLY_END))
    assert ended[-1]["choices"][0]["finish_reason"] == "stop" and len(ended) < 10  # the model ended it early

    stream = sse_events(port, {**EARLY_END, "ignore_eos": True})
    while not next(stream)["choices"][0]["delta"].get("content"):  # the first token: generating
        pass
    daemon.proc.send_signal(signal.SIGTERM)
    rest = list(stream)
    pieces, last = rest[:-1], rest[-1]
    assert pieces and all(e["choices"][0]["finish_reason"] is None for e in pieces)  # streamed while draining
    assert "error" in last, f"the stream ended before the drain did: {last}"
    assert "cancelled" in last["error"]["message"] and last["error"]["type"] == "server_error"
    assert daemon.proc.wait(30) == 0
    assert "draining requests" in daemon.log() and "stopped" in daemon.log()
