"""Model files are data from strangers (docs/security.md): attacks planted in temp folders and
registered with a live daemon (SmolLM2 on the CPU, no tenants: every caller may create models), each
refused with a 4xx naming the cap or the rule, and the daemon still gives the same greedy answer after.

- crafted GGUF headers (tests/crafted_gguf.py, the `gguf` package's writer): 2e8 layers, a merge-less
  SentencePiece vocabulary of one huge token or of millions of splits;
- a Hugging Face folder whose chat_template.jinja is a symlink out of the folder (its target must not
  come back in /api/show), and one whose *.safetensors is a FIFO (it must not block a thread);
- Ollama manifests whose layer digests walk out of the store;
- Modelfile values holding \"\"\" and a newline, which must not rewrite FROM.
"""

from __future__ import annotations

import json
import os
import re
import threading

import psutil
import pytest
from crafted_gguf import crafted_gguf
from daemon_fixture import MODEL, http, serving
from ollama_store_fixture import MEDIA, add_blob, add_model

from gpushare.catalog.modelfile import parse_modelfile
from gpushare.catalog.tokenizer import MAX_PIECE_CHARS, MAX_RECOVERY_SPLITS

SECRET = "TOP-SECRET-CONTENT-5d1f"
GREEDY = {"model": MODEL, "prompt": "The capital of France is", "stream": False, "raw": True,
          "options": {"temperature": 0, "num_predict": 8}}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """An Ollama store whose manifests name blobs by traversing digests (and one good model)."""
    root = tmp_path_factory.mktemp("ollama-store")
    (root.parent / "outside-secret.txt").write_text(SECRET)
    good = add_model(root, "fine", "latest", b"GGUF" + b"\0" * 60, {"system": "be brief"})
    manifest = json.loads(good.read_text())
    model_layer = manifest["layers"][0]
    # blobs/ joined with "../../x" or "/abs/x" is that file; "sha256:abc" is just not a digest
    for name, digest in [("walker", "../../outside-secret.txt"), ("absolute", str(root.parent / "outside-secret.txt")),
                         ("short", "sha256:abc")]:
        evil = {**manifest, "layers": [model_layer, {"mediaType": MEDIA + "system", "digest": digest}]}
        path = root / "manifests" / "registry.ollama.ai" / "library" / name / "latest"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(evil))
    add_blob(root, b"unused")
    return root


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_path, store):
    with serving(tmp_path_factory.mktemp("secfiles"), smollm2_path, env={"OLLAMA_MODELS": str(store)}) as d:
        yield d


@pytest.fixture(scope="module")
def greedy_answer(daemon):
    status, body, _ = http("POST", daemon.url + "/api/generate", GREEDY)
    assert status == 200, body
    return body["response"]


def still_serves(daemon, greedy_answer) -> None:
    status, body, _ = http("POST", daemon.url + "/api/generate", GREEDY)
    assert status == 200 and body["response"] == greedy_answer


def create(daemon, name: str, path) -> None:
    status, body, _ = http("POST", daemon.url + "/api/create", {"model": name, "from": str(path)})
    assert status == 200, body


def rss_mib(daemon) -> float:
    return psutil.Process(daemon.proc.pid).memory_info().rss / 2**20


@pytest.mark.parametrize("name, numbers, tokens, message", [
    ("layers-bomb", {"block_count": 200_000_000}, None,
     r"llama.block_count 200000000 is out of range \(1 to 1024, the cap on num_layers\)"),
    ("heads-bomb", {"head_count": 100_000}, None,
     r"llama.attention.head_count 100000 is out of range \(1 to 1024, the cap on num_heads\)"),
    ("long-piece", {}, ["<unk>", "a" * 200_000], f"at most {MAX_PIECE_CHARS} characters \\(MAX_PIECE_CHARS\\)"),
    ("many-splits", {}, ["<unk>"] + [f"{i:06d}" + "x" * 500 for i in range(9000)],
     f"at most {MAX_RECOVERY_SPLITS} \\(MAX_RECOVERY_SPLITS\\)"),
])
def test_a_crafted_gguf_header_is_refused_naming_the_cap(daemon, greedy_answer, tmp_path, name, numbers, tokens,
                                                         message):
    create(daemon, name, crafted_gguf(tmp_path / f"{name}.gguf", tokens, **numbers))
    before_mib = rss_mib(daemon)
    asks = [("/api/generate", {"model": name, "prompt": "hi", "stream": False})]
    if numbers:  # the architecture's numbers are read by /api/show too; the vocabulary only at load
        asks.append(("/api/show", {"model": name}))
    for path, body in asks:
        status, reply, _ = http("POST", daemon.url + path, body)
        assert status == 422 and re.search(message, reply["error"]), (path, reply)
    assert rss_mib(daemon) - before_mib < 300  # what the unbounded file took: 1.2-1.5 GiB
    still_serves(daemon, greedy_answer)


def hf_folder(path, template: str | None = None) -> os.PathLike:
    """A Hugging Face folder with a config.json (all /api/show reads) and nothing else."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 256}))
    if template is not None:
        (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return path


def test_a_symlink_leaving_the_folder_is_refused_and_its_target_not_shown(daemon, greedy_answer, tmp_path):
    secret = tmp_path / "private" / "notes.txt"
    secret.parent.mkdir()
    secret.write_text(SECRET)
    leaking = hf_folder(tmp_path / "leaking")
    (leaking / "chat_template.jinja").symlink_to(secret)
    create(daemon, "leaking", leaking)
    status, body, _ = http("POST", daemon.url + "/api/show", {"model": "leaking"})
    assert status == 422, body
    assert "chat_template.jinja is a symbolic link that leaves the model's folder: refused" in body["error"]
    assert SECRET not in json.dumps(body) and "private" not in json.dumps(body)
    # a link that stays inside the folder is fine
    inside = hf_folder(tmp_path / "inside")
    (inside / "templates").mkdir()
    (inside / "templates" / "chat.jinja").write_text("{{ messages[0]['content'] }}")
    (inside / "chat_template.jinja").symlink_to(inside / "templates" / "chat.jinja")
    create(daemon, "inside", inside)
    status, body, _ = http("POST", daemon.url + "/api/show", {"model": "inside"})
    assert status == 200 and body["template"] == "{{ messages[0]['content'] }}"
    still_serves(daemon, greedy_answer)


def test_a_fifo_is_refused_at_once_and_blocks_no_thread(daemon, greedy_answer, tmp_path):
    names = [f"fifo-{i}" for i in range(6)]
    for name in names:
        folder = hf_folder(tmp_path / name)
        os.mkfifo(folder / "model.safetensors")
        create(daemon, name, folder)
    replies = {}

    def ask(name):
        replies[name] = http("POST", daemon.url + "/api/generate", {"model": name, "prompt": "hi", "stream": False},
                             timeout_s=60)

    threads = [threading.Thread(target=ask, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert set(replies) == set(names)  # every one answered: none waits on its FIFO
    for status, body, _ in replies.values():
        assert status == 422 and "model.safetensors is not a regular file (a FIFO, device or socket)" in body["error"]
    # a FIFO chat template, too
    folder = hf_folder(tmp_path / "fifo-template")
    os.mkfifo(folder / "chat_template.jinja")
    create(daemon, "fifo-template", folder)
    status, body, _ = http("POST", daemon.url + "/api/show", {"model": "fifo-template"}, timeout_s=30)
    assert status == 422 and "chat_template.jinja is not a regular file" in body["error"]
    still_serves(daemon, greedy_answer)


def test_manifest_digests_that_leave_the_store_are_refused(daemon, greedy_answer, store):
    status, tags, _ = http("GET", daemon.url + "/api/tags")
    names = {m["name"] for m in tags["models"]}
    assert "fine:latest" in names and not names & {"walker:latest", "absolute:latest", "short:latest"}
    skipped = "\n".join(tags["skipped"])
    for name in ("walker", "absolute", "short"):
        assert f"manifests/registry.ollama.ai/library/{name}/latest: a layer's digest" in skipped
    assert "is not sha256:<64 hex digits>" in skipped and SECRET not in json.dumps(tags)
    status, body, _ = http("POST", daemon.url + "/api/show", {"model": "walker"})
    assert status == 404 and SECRET not in json.dumps(body)
    still_serves(daemon, greedy_answer)


def test_a_modelfile_value_cannot_rewrite_from(daemon, greedy_answer):
    """A line of the value ending in a closing \"\"\" : no Ollama form holds it, so it is refused."""
    system = 'x"""\nFROM /etc/passwd\nSYSTEM """y'
    status, body, _ = http("POST", daemon.url + "/api/create", {"model": "sneaky", "from": MODEL, "system": system})
    assert status == 400 and "cannot be written in a Modelfile" in body["error"], body
    assert http("POST", daemon.url + "/api/show", {"model": "sneaky"})[0] == 404
    still_serves(daemon, greedy_answer)


@pytest.mark.parametrize("system", ['one"\nFROM /etc/passwd\nSYSTEM "two', 'say """hi""" and "bye"\nthen """stop""" here',
                                    '"quoted"', "  spaced  ", "# not a comment"])
def test_quotes_a_modelfile_can_hold_round_trip(daemon, greedy_answer, smollm2_path, system):
    status, body, _ = http("POST", daemon.url + "/api/create", {"model": "quoting", "from": MODEL, "system": system})
    assert status == 200, body
    status, shown, _ = http("POST", daemon.url + "/api/show", {"model": "quoting"})
    assert status == 200 and shown["system"] == system
    stored = parse_modelfile((daemon.models_dir / "quoting.modelfile").read_text())  # what the daemon reads back
    assert stored.base == smollm2_path and stored.preset.system == system
    assert parse_modelfile(shown["modelfile"]).preset.system == system
    still_serves(daemon, greedy_answer)
