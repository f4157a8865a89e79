"""LoRA adapters as models through a live daemon: a tiny random Llama base (a safetensors folder) and
peft adapters made here, named like any model in every dialect. One adapter comes from the config
(models[].adapter + base), one from a Modelfile's ADAPTER through /api/create, one from an Ollama
store manifest's adapter layer (a GGUF LoRA, q and k in llama.cpp's RoPE row order). Each answer equals the offline LLM's for that adapter
(tests/test_lora_oracle.py holds the offline LLM to peft's answers); /api/ps shows the base once with
its adapters; an adapter loads on the resident base without reloading it; bad adapters get their 4xx
and the base keeps serving. Adapter files are data from strangers: a link out of the folder or a FIFO
is refused, never followed, quoted or waited on; deleting a pulled model keeps the blobs other models
use; a chunked blob upload is held to the free disk (faked nearly full at the disk's boundary)."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
from http.client import HTTPConnection

import numpy as np
import ollama
import openai
import pytest

from arch_models import _permute, hf_to_gguf, save_hf_model
from gpushare import LLM, SamplingParams
from gpushare.catalog.blob_store import DISK_MARGIN_BYTES, TEST_FREE_DISK_ENV
from tests.daemon_fixture import GPUSHARE, http, serving, wait_for
from test_lora_oracle import make_adapter

BASE, CONFIGURED, CREATED, STORED = "tiny", "fine-a", "fine-b", "fine-c:latest"
FREE_DISK_BYTES = DISK_MARGIN_BYTES + (16 << 20)  # the daemon's models disk, faked nearly full: 16 MiB to use
PROMPT = "Tell me about the history of Paris and the river"
NEW_TOKENS = 12
TENANTS = [{"name": "alice", "api_keys": ["alice-key"], "models": [BASE, CONFIGURED]},
           {"name": "bob", "api_keys": ["bob-key"], "models": [BASE, CREATED]},
           {"name": "admin", "api_keys": ["admin-key"], "admin": True}]
ADMIN = {"Authorization": "Bearer admin-key"}


def write_gguf_lora(peft_folder: str, base_folder: str, path: str, arch: str = "llama") -> None:
    """The peft adapter as llama.cpp's convert_lora_to_gguf writes it, saying it is for `arch`: q and k lora_B
    rows in the GGUF's RoPE order, as the base's q and k weights are."""
    import gguf
    from safetensors.torch import load_file

    config = json.load(open(f"{peft_folder}/adapter_config.json"))
    base = json.load(open(f"{base_folder}/config.json"))
    heads = {"q_proj": base["num_attention_heads"], "k_proj": base["num_key_value_heads"]}
    tensors = {}
    gguf_name = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                 "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    for key, t in load_file(f"{peft_folder}/adapter_model.safetensors").items():
        layer = int(key.split("layers.")[1].split(".")[0])
        module = next(m for m in gguf_name if f".{m}." in key)
        half = "a" if "lora_A" in key else "b"
        if half == "b" and module in heads:
            t = _permute(t, heads[module])
        tensors[f"blk.{layer}.{gguf_name[module]}.weight.lora_{half}"] = t.numpy().astype(np.float32)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(config["lora_alpha"]))
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def store_model(root, name: str, layers: list[tuple[str, bytes]]) -> list[str]:
    """A store (Ollama's layout, as `ollama pull` and `gpushare pull` leave it) whose manifest NAME:latest
    has these (media type, bytes) layers; their digests."""
    entries = []
    for media, data in layers:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        (root / "blobs").mkdir(parents=True, exist_ok=True)
        (root / "blobs" / digest.replace(":", "-")).write_bytes(data)
        entries.append({"mediaType": f"application/vnd.ollama.image.{media}", "digest": digest, "size": len(data)})
    folder = root / "manifests" / "registry.ollama.ai" / "library" / name
    folder.mkdir(parents=True)
    (folder / "latest").write_text(json.dumps({"schemaVersion": 2, "layers": entries}))
    return [e["digest"] for e in entries]


@pytest.fixture(scope="module")
def family(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("lora-daemon")
    base = save_hf_model("llama", str(root / "base"), smollm2_path)
    folders = {CONFIGURED: str(root / "a"), CREATED: str(root / "b"), STORED: str(root / "c")}
    make_adapter(base, folders[CONFIGURED], 8, seed=1)
    make_adapter(base, folders[CREATED], 16, seed=2)
    make_adapter(base, folders[STORED], 8, seed=3)
    return root, base, folders


@pytest.fixture(scope="module")
def expected(family):
    """The offline LLM's greedy text for the base and each adapter (the daemon runs the same float32 path)."""
    _, base, folders = family
    llm = LLM(base, dtype="float32", weights="float32", kv_dtype="float32", num_threads=2)
    try:
        for name, folder in folders.items():
            llm.load_adapter(name, folder)
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        answers = {name: llm.generate([PROMPT], params, adapter=name)[0].text for name in [None, *folders]}
    finally:
        llm.shutdown()
    assert len(set(answers.values())) == len(answers)  # each adapter's answer is its own
    return answers


@pytest.fixture(scope="module")
def daemon(family, smollm2_path):
    root, base, folders = family
    store = root / "ollama-store"
    # The store's model layer is a GGUF; the adapter is served on the model of the same blob, its own base.
    write_gguf_lora(folders[STORED], base, str(root / "c.gguf"))
    base_gguf = hf_to_gguf(base, str(root / "base.gguf"), smollm2_path)
    store_model(store, "fine-c", [("model", open(base_gguf, "rb").read()), ("adapter", open(root / "c.gguf", "rb").read())])
    overrides = {"models": [{"name": BASE, "path": base},
                            {"name": CONFIGURED, "adapter": folders[CONFIGURED], "base": BASE}],
                 "engine": {"weights": "float32", "kv_dtype": "float32", "max_num_seqs": 4,
                            "max_num_batched_tokens": 512},
                 "tenants": TENANTS, "memory": {"kv_budget": "64MiB", "max_loaded_models": 2}}
    with serving(root, base, overrides, env={"OLLAMA_MODELS": str(store), TEST_FREE_DISK_ENV: str(FREE_DISK_BYTES)}) as d:
        yield d


def generate(daemon, model: str, key: str = "admin-key", **extra) -> tuple[int, dict]:
    body = {"model": model, "prompt": PROMPT, "raw": True, "stream": False,
            "options": {"temperature": 0, "num_predict": NEW_TOKENS}, **extra}
    status, answer, _ = http("POST", daemon.url + "/api/generate", body, headers={"Authorization": f"Bearer {key}"})
    return status, answer


def ps(daemon) -> dict[str, dict]:
    return {m["name"]: m for m in http("GET", daemon.url + "/api/ps", headers=ADMIN)[1]["models"]}


def metric(daemon, name: str, model: str) -> float:
    text = http("GET", daemon.url + "/metrics", headers=ADMIN)[1]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and f'model="{model}"' in line)


def create_from_modelfile(daemon, name: str, modelfile: str) -> tuple[int, dict]:
    status, body, _ = http("POST", daemon.url + "/api/create", {"model": name, "modelfile": modelfile,
                                                                  "stream": False}, headers=ADMIN)
    return status, body


def test_the_configured_adapter_answers_as_the_offline_llm_in_every_dialect(daemon, expected):
    status, answer = generate(daemon, CONFIGURED)
    assert status == 200, answer
    assert answer["response"] == expected[CONFIGURED]
    client = ollama.Client(host=daemon.url, headers=ADMIN)
    chat = client.chat(model=CONFIGURED, messages=[{"role": "user", "content": "Hi"}],
                       options={"temperature": 0, "num_predict": 4})
    assert chat.message.content and chat.model == CONFIGURED
    oa = openai.OpenAI(base_url=daemon.url + "/v1", api_key="admin-key")
    completion = oa.completions.create(model=CONFIGURED, prompt=PROMPT, temperature=0, max_tokens=NEW_TOKENS,
                                       extra_body={"ignore_eos": True})
    assert completion.choices[0].text == expected[CONFIGURED]
    reply = oa.chat.completions.create(model=CONFIGURED, messages=[{"role": "user", "content": "Hi"}],
                                       temperature=0, max_tokens=4)
    assert reply.choices[0].message.content == chat.message.content  # the same adapter, the same chat


def test_a_modelfile_adapter_loads_on_the_resident_base_without_reloading_it(daemon, expected, family):
    _, _, folders = family
    assert generate(daemon, BASE)[1]["response"] == expected[None]
    base_loads = metric(daemon, "gpushare_model_loads_total", BASE)
    base_load_ns = ps(daemon)[BASE]["load_duration"]
    status, body = create_from_modelfile(daemon, CREATED, f"FROM {BASE}\nADAPTER {folders[CREATED]}\n")
    assert status == 200, body
    status, answer = generate(daemon, CREATED)
    assert status == 200, answer
    assert answer["response"] == expected[CREATED]
    assert answer["load_duration"] > 0  # the adapter's own load, as Ollama reports a load
    rows = ps(daemon)
    assert metric(daemon, "gpushare_model_loads_total", BASE) == base_loads
    assert rows[BASE]["load_duration"] == base_load_ns and "base" not in rows[BASE]
    assert rows[CREATED]["base"] == BASE and 0 < rows[CREATED]["size"] < rows[BASE]["weight_bytes"]
    assert rows[CREATED]["kv_committed_bytes"] == 0  # its KV is the base's, counted on the base's row
    assert [name for name in rows].count(BASE) == 1
    assert generate(daemon, CREATED)[1]["load_duration"] == 0  # resident now


def test_gpushare_create_reads_adapter_relative_to_the_modelfile_ollamas_client_uploads_one_and_copies_one(
        daemon, expected, family, tmp_path):
    root, _, folders = family
    shutil.copytree(folders[CREATED], tmp_path / "lora")
    (tmp_path / "Modelfile").write_text(f"FROM {BASE}\nADAPTER ./lora\nPARAMETER temperature 0\n")
    out = subprocess.run([str(GPUSHARE), "create", "fine-b-cli", "-f", str(tmp_path / "Modelfile")],
                         capture_output=True, text=True, timeout=60,
                         env={**daemon.env(), "GPUSHARE_API_KEY": "admin-key"})
    assert out.returncode == 0, out.stderr
    assert generate(daemon, "fine-b-cli")[1]["response"] == expected[CREATED]
    client = ollama.Client(host=daemon.url, headers=ADMIN)
    digest = client.create_blob(root / "c.gguf")  # the GGUF LoRA the store fixture wrote
    client.create(model="fine-c-blob", from_=BASE, adapters={"c.gguf": digest})
    assert generate(daemon, "fine-c-blob")[1]["response"] == expected[STORED]  # on the folder base this time
    client.copy(CONFIGURED, "fine-a-copy")  # a copy is the same adapter on the same base
    assert generate(daemon, "fine-a-copy")[1]["response"] == expected[CONFIGURED]


def test_gpushare_ps_shows_each_adapter_with_its_base(daemon):
    assert generate(daemon, CONFIGURED)[0] == 200
    out = subprocess.run([str(GPUSHARE), "ps"], capture_output=True, text=True, timeout=60,
                         env={**daemon.env(), "GPUSHARE_API_KEY": "admin-key"})
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines()[1:]}
    assert lines[CONFIGURED].rstrip().endswith(BASE) and not lines[BASE].rstrip().endswith(BASE)


def test_two_tenants_with_their_own_adapters_at_once_each_get_their_own_answer(daemon, expected):
    answers = {}

    def ask(key, model):
        answers[key] = generate(daemon, model, key)

    threads = [threading.Thread(target=ask, args=("alice-key", CONFIGURED)),
               threading.Thread(target=ask, args=("bob-key", CREATED))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers["alice-key"][1]["response"] == expected[CONFIGURED]
    assert answers["bob-key"][1]["response"] == expected[CREATED]
    status, body = generate(daemon, CREATED, "alice-key")  # the allow-list names adapters by their own name
    assert status == 403, body
    assert metric(daemon, "gpushare_generated_tokens_total", CREATED) >= NEW_TOKENS
    assert metric(daemon, "gpushare_requests_total", CONFIGURED) >= 1


def test_an_ollama_store_adapter_layer_is_served_on_its_model_layer(daemon, expected):
    tags = {m["name"] for m in http("GET", daemon.url + "/api/tags", headers=ADMIN)[1]["models"]}
    assert STORED in tags
    status, answer = generate(daemon, STORED)
    assert status == 200, answer
    # Its base is the GGUF of the same weights (in float32 both): the same answer as the folder's adapter.
    assert answer["response"] == expected[STORED]
    assert ps(daemon)[STORED]["base"] != BASE  # the model layer's blob is a model of its own


def test_unloading_the_base_first_detaches_its_adapters(daemon, expected):
    assert generate(daemon, CONFIGURED)[0] == 200
    status, body, _ = http("POST", daemon.url + "/api/generate", {"model": BASE, "keep_alive": 0}, headers=ADMIN)
    assert status == 200 and body["done_reason"] == "unload", body
    rows = ps(daemon)
    assert BASE not in rows and CONFIGURED not in rows and CREATED not in rows
    assert generate(daemon, CONFIGURED)[1]["response"] == expected[CONFIGURED]  # base and adapter load again


@pytest.mark.parametrize("case", ["other base", "other architecture", "rank 4096", "unknown target", "corrupt file"])
def test_bad_adapters_are_refused_with_a_4xx_and_the_base_keeps_serving(daemon, family, expected, smollm2_path,
                                                                      case, tmp_path):
    root, base, folders = family
    bad = tmp_path / "bad"
    if case == "other base":
        make_adapter(save_hf_model("qwen3", str(tmp_path / "qwen3"), smollm2_path), str(bad), 8, seed=9)
    elif case == "other architecture":
        bad = tmp_path / "bad.gguf"
        write_gguf_lora(folders[STORED], base, str(bad), arch="qwen3")
    else:
        shutil.copytree(folders[CONFIGURED], bad)
        config = json.load(open(bad / "adapter_config.json"))
        if case == "rank 4096":
            config["r"] = 4096
        elif case == "unknown target":
            config["target_modules"] = ["q_proj", "lm_head"]
        else:
            with open(bad / "adapter_model.safetensors", "r+b") as f:
                f.write(b"\xff" * 64)
        json.dump(config, open(bad / "adapter_config.json", "w"))
    name = "bad-" + case.replace(" ", "-")
    status, body = create_from_modelfile(daemon, name, f"FROM {BASE}\nADAPTER {bad}\n")
    assert status == 200, body
    status, answer = generate(daemon, name)
    assert status == 422, answer
    want = {"other base": rf"does not fit base '{BASE}': layer 0 down lora_A is \[8, 128\], the base needs "
                          r"\[8, 512\]",
            "other architecture": rf"is for architecture 'qwen3', base '{BASE}' is 'llama'",
            "rank 4096": r"rank 4096 is not covered \(ranks 1 to 64\)",
            "unknown target": r"target modules \['lm_head'\] are not covered",
            "corrupt file": r"adapter_model.safetensors: corrupt safetensors header"}[case]  # sized before loading
    assert re.search(want, answer["error"]) and name in answer["error"], answer
    assert name not in ps(daemon)
    assert generate(daemon, BASE)[1]["response"] == expected[None]


def test_create_refuses_a_missing_adapter_and_an_adapter_of_an_adapter(daemon, tmp_path):
    status, body = create_from_modelfile(daemon, "nothing", f"FROM {BASE}\nADAPTER {tmp_path}/none\n")
    assert status == 400 and "neither a PEFT folder" in body["error"], body
    status, body = create_from_modelfile(daemon, "twice", f"FROM {CONFIGURED}\nADAPTER {tmp_path}\n")
    assert status == 400, body


def test_an_adapter_does_not_embed(daemon):
    status, body, _ = http("POST", daemon.url + "/api/embed", {"model": CONFIGURED, "input": "Hi"}, headers=ADMIN)
    assert status == 400 and "is a LoRA adapter" in body["error"], body


def test_an_adapter_config_linked_out_of_its_folder_is_refused_and_never_quoted(daemon, family, tmp_path):
    _, _, folders = family
    secret = tmp_path / "secret.json"  # a JSON file elsewhere on the node, readable by the daemon
    config = json.load(open(f"{folders[CONFIGURED]}/adapter_config.json"))
    secret.write_text(json.dumps({**config, "peft_type": "TOPSECRET-7f3a", "r": "TOPSECRET-r"}))
    for name in ("linked", "swapped"):
        shutil.copytree(folders[CONFIGURED], tmp_path / name)
    (tmp_path / "linked" / "adapter_config.json").unlink()
    (tmp_path / "linked" / "adapter_config.json").symlink_to(secret)
    status, body = create_from_modelfile(daemon, "linked-out", f"FROM {BASE}\nADAPTER {tmp_path / 'linked'}\n")
    assert status == 400 and "adapter_config.json is a symbolic link that leaves the model's folder" in body["error"]
    assert "TOPSECRET" not in json.dumps(body)
    status, body = create_from_modelfile(daemon, "swapped-out", f"FROM {BASE}\nADAPTER {tmp_path / 'swapped'}\n")
    assert status == 200, body
    (tmp_path / "swapped" / "adapter_config.json").unlink()  # swapped by whoever writes the folder, after create
    (tmp_path / "swapped" / "adapter_config.json").symlink_to(secret)
    status, answer = generate(daemon, "swapped-out")
    assert status == 422 and "adapter_config.json is a symbolic link that leaves the model's folder" in answer["error"]
    assert "TOPSECRET" not in json.dumps(answer)


def test_a_fifo_swapped_in_after_create_fails_its_load_and_holds_up_no_other(daemon, family, expected, tmp_path):
    _, _, folders = family
    for name in ("fifo", "after-fifo"):
        shutil.copytree(folders[CREATED], tmp_path / name)
        assert create_from_modelfile(daemon, name, f"FROM {BASE}\nADAPTER {tmp_path / name}\n")[0] == 200
    (tmp_path / "fifo" / "adapter_config.json").unlink()
    os.mkfifo(tmp_path / "fifo" / "adapter_config.json")  # an open for reading waits for a writer, for ever
    assert generate(daemon, BASE)[0] == 200  # the base is resident: each adapter goes straight to its attach
    stuck = {}
    thread = threading.Thread(target=lambda: stuck.update(answer=generate(daemon, "fifo")), daemon=True)
    thread.start()
    assert wait_for(lambda: "attaching adapter fifo " in daemon.log(), timeout_s=60), daemon.log()[-2000:]
    status, answer = generate(daemon, "after-fifo")  # http()'s 120 s: a generous bound, never a timing
    assert status == 200 and answer["response"] == expected[CREATED], answer
    thread.join(timeout=120)
    status, answer = stuck["answer"]
    assert status == 422 and "adapter_config.json is not a regular file" in answer["error"], answer


def test_deleting_a_pulled_model_keeps_the_uploaded_adapter_blob_another_model_uses(daemon, family, expected):
    root, _, _ = family
    client = ollama.Client(host=daemon.url, headers=ADMIN)
    digest = client.create_blob(root / "c.gguf")
    client.create(model="fine-c-kept", from_=BASE, adapters={"c.gguf": digest})
    assert generate(daemon, "fine-c-kept")[1]["response"] == expected[STORED]
    (unrelated,) = store_model(daemon.models_dir, "unrelated", [("model", open(root / "base.gguf", "rb").read())])
    assert "unrelated:latest" in {m.model for m in client.list().models}
    client.delete("unrelated:latest")
    blobs = daemon.models_dir / "blobs"
    assert not (blobs / unrelated.replace(":", "-")).exists()  # what no model uses still goes
    assert (blobs / digest.replace(":", "-")).is_file()
    assert generate(daemon, "fine-c-kept")[1]["response"] == expected[STORED]


def upload_chunked(daemon, data: bytes) -> tuple[int, dict]:
    """POST /api/blobs/<digest> with no Content-Length, as Ollama's Go client uploads a file."""
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    conn = HTTPConnection(daemon.host, timeout=120)
    chunks = (data[i:i + (1 << 20)] for i in range(0, len(data), 1 << 20))
    conn.request("POST", f"/api/blobs/{digest}", chunks, ADMIN, encode_chunked=True)
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, json.loads(body) if body else {}


def test_a_chunked_upload_larger_than_the_free_disk_is_refused_and_nothing_of_it_stays(daemon):
    status, body = upload_chunked(daemon, b"small" * 1000)
    assert status == 201, body  # a chunked upload that fits is stored
    big = os.urandom(FREE_DISK_BYTES - DISK_MARGIN_BYTES + (1 << 20))
    status, body = upload_chunked(daemon, big)
    assert status == 400 and "not enough disk space" in body["error"] and "this upload needs" in body["error"], body
    assert not list((daemon.models_dir / "blobs").glob(f"sha256-{hashlib.sha256(big).hexdigest()}*"))
