"""`gpushare pull`, POST /api/pull and the official `ollama` client against a live daemon and a registry
served on 127.0.0.1 by the test (registry_fixture.py): the bundled SmolLM2 GGUF as Ollama's registry
serves a model (config, model, params, template and license blobs), the same GGUF as a Hugging Face
quant reached through HF_ENDPOINT with HF_TOKEN, and a tiny random safetensors model built with
transformers behind a fake Hugging Face API. Pulled models list and answer as transformers does; bad
blobs, unknown names and too little disk are clear errors and the daemon keeps serving; rm drops
the blobs no other model uses."""

import hashlib
import json
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import ollama
import pytest

from arch_models import save_hf_model
from daemon_fixture import GPUSHARE, MODEL, http, serving
from registry_fixture import HfRepo, Registry, Serving
from test_oracle import NEW_TOKENS, conversations

HF_TOKEN = "hf_test_token"
PARAMS = {"temperature": 0, "num_predict": 64}


def oracle_text(hf_model, llm, conversation: list[dict]) -> str:
    """transformers' greedy answer to one chat (NEW_TOKENS tokens), as text."""
    import torch

    model, tokenizer = hf_model
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return llm.tokenizer.decode([t for t in out[0, len(ids):].tolist() if t not in llm.model.stop_token_ids])


@pytest.fixture(scope="module")
def registry(smollm2_path):
    reg = Registry()
    gguf = Path(smollm2_path)
    reg.add_model("library", "smol", "q4", gguf, {"params": PARAMS, "template": "{{ .Prompt }}",
                                                    "license": "Apache 2.0"})
    reg.add_model("library", "smol-cli", "q4", gguf, {"params": {"temperature": 0.5}})
    reg.add_model("testuser", "SmolLM2-GGUF", "Q4_1", gguf)
    serving = Serving(reg)
    yield reg
    serving.stop()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, smollm2_path):
    return Path(save_hf_model("llama", str(tmp_path_factory.mktemp("tiny")), smollm2_path))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_path, registry):
    tmp = tmp_path_factory.mktemp("pull")
    # HF_HUB_OFFLINE=0: the encoder tests' helpers set it to 1 for this whole test process, and a
    # daemon started after them would inherit it and never reach the registry on 127.0.0.1
    env = {"HF_ENDPOINT": f"http://{registry.host}", "HF_TOKEN": HF_TOKEN, "HF_HOME": str(tmp / "hf-home"),
           "HF_HUB_OFFLINE": "0"}
    overrides = {"engine": {"weights": "float32"}, "server": {"pull_rate_while_serving": "1MiB"}}
    with serving(tmp, smollm2_path, overrides, env=env) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def client(daemon):
    return ollama.Client(host=daemon.url, timeout=300)


def gguf_digest(smollm2_path) -> str:
    with open(smollm2_path, "rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


def test_the_ollama_client_pulls_with_progress_and_success(client, registry, smollm2_path, monkeypatch):
    name = f"{registry.host}/library/smol:q4"
    # a link of 16 MB/s a connection: the ~98 MB layer takes most of a second in 8 ranges, as a real pull
    # takes long enough to report progress (over loopback it could end before the second report)
    monkeypatch.setattr(registry, "bytes_per_s", 16e6)
    lines = list(client.pull(name, insecure=True, stream=True))
    statuses = [line.status for line in lines]
    digest, size = gguf_digest(smollm2_path), Path(smollm2_path).stat().st_size
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert statuses.index("verifying sha256 digest") < statuses.index("writing manifest") < len(statuses) - 1
    layer = [line for line in lines if line.digest == digest]
    assert layer[0].status == f"pulling {digest[7:19]}" and layer[0].total == size
    assert layer[-1].completed == size and len(layer) > 2  # progress, not one jump
    assert {line.digest for line in lines if line.digest} == {json.loads(registry.manifests[("library", "smol", "q4")])
                                                             ["config"]["digest"]} | {
        x["digest"] for x in json.loads(registry.manifests[("library", "smol", "q4")])["layers"]}


def test_the_pulled_model_lists_and_answers_as_transformers(client, daemon, registry, smollm2_path, llm, hf_model):
    name = f"{registry.host}/library/smol:q4"
    listed = {m.model: m for m in client.list().models}
    assert listed[name].size == Path(smollm2_path).stat().st_size
    assert listed[name].digest == gguf_digest(smollm2_path)[7:]
    shown = client.show(name)
    assert re.search(r"^temperature +0$", shown.parameters, re.M) and shown.license == "Apache 2.0"
    answer = client.chat(name, conversations()[0], options={"num_predict": NEW_TOKENS})
    assert answer.message.content == oracle_text(hf_model, llm, conversations()[0])


def test_an_unknown_name_is_a_clear_404(client, registry):
    with pytest.raises(ollama.ResponseError) as e:
        client.pull(f"{registry.host}/library/nope:latest", insecure=True)
    assert e.value.status_code == 404 and "not found" in e.value.error and "library/nope" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("../etc/passwd", insecure=True)
    assert e.value.status_code == 400 and "invalid model name" in e.value.error


def test_a_bad_blob_or_too_little_disk_fails_the_pull_keeps_nothing_and_the_daemon_serves(daemon, registry):
    manifest = registry.add_model("library", "corrupt", "q4", b"GGUF" + bytes(range(256)) * 4096)
    bad = manifest["layers"][0]["digest"]
    registry.corrupt.add(bad)
    status, body, _ = http("POST", daemon.url + "/api/pull", {"model": f"{registry.host}/library/corrupt:q4",
                                                               "insecure": True})
    lines = [json.loads(line) for line in body.splitlines()]
    assert status == 200 and f"blob {bad} arrived with SHA-256" in lines[-1]["error"]
    assert not [p for p in (daemon.models_dir / "blobs").iterdir() if bad[7:] in p.name]
    huge = registry.add_model("library", "huge", "q4", b"GGUF" + bytes(1000))
    huge["layers"][0]["size"] = 10 ** 15
    registry.manifests[("library", "huge", "q4")] = json.dumps(huge).encode()
    status, body, _ = http("POST", daemon.url + "/api/pull", {"model": f"{registry.host}/library/huge:q4",
                                                               "insecure": True})
    assert status == 400 and "not enough disk space" in body["error"] and "are free" in body["error"]
    status, body, _ = http("POST", daemon.url + "/api/generate", {"model": MODEL, "prompt": "Hi", "stream": False,
                                                                   "options": {"temperature": 0, "num_predict": 4}})
    assert status == 200 and body["done"]


def test_a_pull_while_a_model_generates_keeps_to_the_configured_rate_and_speeds_up_after(daemon, registry):
    """server.pull_rate_while_serving (1 MiB/s here) caps the download while a loaded model has
    requests; once they are done the rest comes as fast as the link gives."""
    blob_bytes = 6 << 20
    registry.add_model("library", "capped", "v1", os.urandom(blob_bytes))
    chat = urllib.request.urlopen(urllib.request.Request(daemon.url + "/api/generate", json.dumps(
        {"model": MODEL, "prompt": "Count to a thousand.", "stream": True,
         "options": {"temperature": 0, "num_predict": 2000}}).encode(), method="POST"), timeout=300)
    chat.readline()  # the model is generating
    pull = urllib.request.urlopen(urllib.request.Request(daemon.url + "/api/pull", json.dumps(
        {"model": f"{registry.host}/library/capped:v1", "insecure": True}).encode(), method="POST"), timeout=300)
    first_s = None
    try:
        for line in pull:
            event = json.loads(line)
            if event.get("total") == blob_bytes and event.get("completed"):
                first_s = first_s or time.monotonic()
                if time.monotonic() - first_s >= 2.0:
                    break
        assert first_s is not None, "no progress on the blob"
        completed = event["completed"]
        assert completed <= (time.monotonic() - first_s + 1.0) * (1 << 20) + (256 << 10), completed
        chat.close()  # the model goes idle: the cap ends a second later
        events = [json.loads(line) for line in pull]
    finally:
        chat.close()
        pull.close()
    assert events[-1] == {"status": "success"}
    assert time.monotonic() - first_s < 2.0 + (blob_bytes - completed) / (1 << 20), "the cap outlived the chat"
    assert http("DELETE", daemon.url + "/api/delete", {"model": f"{registry.host}/library/capped:v1"})[0] == 200


def test_hf_names_resolve_through_hf_endpoint_with_hf_token(daemon, registry, smollm2_path):
    gguf_gets = len(registry.blob_requests(gguf_digest(smollm2_path)))
    status, body, _ = http("POST", daemon.url + "/api/pull", {"model": "hf.co/testuser/SmolLM2-GGUF:Q4_1",
                                                               "stream": False})
    assert status == 200 and body == {"status": "success"}
    [seen] = [r for r in registry.requests if r.path == "/v2/testuser/SmolLM2-GGUF/manifests/Q4_1"]
    assert seen.authorization == f"Bearer {HF_TOKEN}"
    assert len(registry.blob_requests(gguf_digest(smollm2_path))) == gguf_gets  # the blob is shared, not fetched
    names = {m["name"] for m in http("GET", daemon.url + "/api/tags")[1]["models"]}
    assert "hf.co/testuser/SmolLM2-GGUF:Q4_1" in names


def test_a_safetensors_repo_is_pulled_through_huggingface_hub_and_answers_as_transformers(daemon, registry,
                                                                                        tiny_folder):
    import torch
    from transformers import AutoModelForCausalLM

    registry.hf_repos["testuser/tiny-llama"] = HfRepo({p.name: p for p in tiny_folder.iterdir() if p.is_file()})
    status, body, _ = http("POST", daemon.url + "/api/pull", {"model": "hf.co/testuser/tiny-llama"})
    lines = [json.loads(line) for line in body.splitlines()]
    assert status == 200 and lines[-1] == {"status": "success"}, lines[-3:]
    pulled = {line["digest"] for line in lines if "digest" in line}
    weights = hashlib.sha256((tiny_folder / "model.safetensors").read_bytes()).hexdigest()
    assert f"sha256:{weights}" in pulled
    info = [r for r in registry.requests if r.path.startswith("/api/models/testuser/tiny-llama")]
    assert info and all(r.authorization == f"Bearer {HF_TOKEN}" for r in info)
    prompt = [1, 504, 1953, 314, 253, 2114, 28, 16, 42]
    oracle = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = oracle.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                   min_new_tokens=8)[0, len(prompt):].tolist()
    status, body, _ = http("POST", daemon.url + "/v1/completions",
                           {"model": "hf.co/testuser/tiny-llama:latest", "prompt": prompt, "max_tokens": 8,
                            "temperature": 0, "ignore_eos": True, "logprobs": 0})
    assert status == 200, body
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tiny_folder / "tokenizer.json"))
    got = body["choices"][0]["logprobs"]["tokens"]
    assert got == [vocab.decode([t], skip_special_tokens=False) for t in expected]


def test_the_official_client_creates_a_model_from_uploaded_blobs(client, daemon, smollm2_path, tmp_path):
    data = b"not a model, just bytes " * 1000
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert http("HEAD", f"{daemon.url}/api/blobs/{digest}")[0] == 404
    status, body, _ = http("POST", f"{daemon.url}/api/blobs/sha256:{'0' * 64}", data)
    assert status == 400 and "arrived with SHA-256" in body["error"]
    assert not list((daemon.models_dir / "blobs").glob("sha256-0000*"))
    assert http("POST", f"{daemon.url}/api/blobs/{digest}", data)[0] == 201
    assert http("HEAD", f"{daemon.url}/api/blobs/{digest}")[0] == 200
    assert http("HEAD", f"{daemon.url}/api/blobs/..%2f..%2fetc")[0] == 400
    gguf = client.create_blob(smollm2_path)
    assert gguf == gguf_digest(smollm2_path)
    client.create("uploaded", files={"smol.gguf": gguf}, parameters={"temperature": 0})
    assert re.fullmatch(r"temperature +0", client.show("uploaded").parameters.strip())
    with pytest.raises(ollama.ResponseError, match="was not uploaded"):
        client.create("missing", files={"x.gguf": f"sha256:{'1' * 64}"})
    client.delete("uploaded")


def test_cli_pull_and_rm_drop_only_the_blobs_no_other_model_uses(daemon, registry, smollm2_path):
    name = f"{registry.host}/library/smol-cli:q4"
    out = subprocess.run([str(GPUSHARE), "pull", "--insecure", name], capture_output=True, text=True, timeout=300,
                         env=daemon.env())
    assert out.returncode == 0, out.stderr
    assert "pulling manifest" in out.stderr and "success" in out.stderr and f"pulled {name}" in out.stdout
    assert f"pulling {gguf_digest(smollm2_path)[7:19]} 100%" in out.stderr
    blob = daemon.models_dir / "blobs" / gguf_digest(smollm2_path).replace(":", "-")
    pulled = sorted(m["name"] for m in http("GET", daemon.url + "/api/tags")[1]["models"] if m["name"] != MODEL)
    assert name in pulled and len(pulled) == 4
    for i, model in enumerate(pulled):
        out = subprocess.run([str(GPUSHARE), "rm", model], capture_output=True, text=True, timeout=120,
                             env=daemon.env())
        assert out.returncode == 0, out.stderr
        still_using_gguf = [m for m in pulled[i + 1:] if "tiny-llama" not in m]
        assert blob.exists() == bool(still_using_gguf), model
    assert [m["name"] for m in http("GET", daemon.url + "/api/tags")[1]["models"]] == [MODEL]
    assert sorted(p.name for p in (daemon.models_dir / "blobs").iterdir()) == []
