"""Pulls from a hostile registry or Hugging Face mirror on 127.0.0.1 (registry_fixture.py) against a live
daemon: what a mirror names never becomes a path outside the store, nothing outside it is written or
deleted, every answer is read with a byte cap (token, manifest, error page, file), a manifest redirect
to another host is refused, two pulls sharing a blob share its download, and pulls beyond
server.max_pulls wait their turn, saying so, then finish."""

import json
import os
import threading
import urllib.request
from pathlib import Path

import pytest

from daemon_fixture import http, serving
from registry_fixture import HfRepo, Registry, Serving

MAX_PULLS = 2
BUFFERED_BYTES = 32 << 20  # what loopback's socket buffers can hold before a sender notices a hang-up


@pytest.fixture(scope="module")
def registry():
    reg = Registry()
    serving_ = Serving(reg)
    yield reg
    serving_.stop()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_path, registry):
    tmp = tmp_path_factory.mktemp("hostile")
    env = {"HF_ENDPOINT": f"http://{registry.host}", "HF_HOME": str(tmp / "hf-home"), "HF_HUB_OFFLINE": "0"}
    with serving(tmp, smollm2_path, {"server": {"max_pulls": MAX_PULLS}}, env=env) as daemon:
        yield daemon


def pull(daemon, model: str) -> list[dict]:
    """POST /api/pull, streamed: every line (an HTTP error's body as one line)."""
    status, body, _ = http("POST", daemon.url + "/api/pull", {"model": model, "insecure": True}, timeout_s=300)
    if status != 200:
        return [{"error": body["error"], "http_status": status}]
    return [json.loads(line) for line in body.splitlines()] if isinstance(body, str) else [body]


def store_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def test_a_mirror_sha_that_is_a_path_is_refused_and_nothing_outside_the_store_is_written_or_deleted(
        daemon, registry, tmp_path):
    sentinel = tmp_path / "sentinel"
    sentinel.mkdir()
    (sentinel / "keep.txt").write_text("mine")
    # the staging folder is .hf-partial/<ns>--<repo>--<sha>: three steps up is models_dir itself
    sha = "../../../" + os.path.relpath(sentinel, daemon.models_dir)
    registry.hf_repos["evil/sha"] = HfRepo({"config.json": b"{}", "model.safetensors": b"\0" * 64}, sha=sha)
    lines = pull(daemon, "hf.co/evil/sha")
    assert "error" in lines[-1] and "commit" in lines[-1]["error"], lines[-3:]
    assert sorted(p.name for p in sentinel.iterdir()) == ["keep.txt"]
    assert (sentinel / "keep.txt").read_text() == "mine"
    registry.hf_repos["evil/dots"] = HfRepo({"config.json": b"{}", "model.safetensors": b"\0" * 64}, sha="..")
    assert "error" in pull(daemon, "hf.co/evil/dots")[-1]
    assert sentinel.is_dir() and daemon.models_dir.is_dir()


def test_a_token_service_answering_without_end_is_cut_at_a_cap(daemon):
    hostile = Registry(token="t")
    hostile.add_model("library", "tok", "v1", b"GGUF" + bytes(64))
    hostile.token_body_bytes = 256 << 20
    server = Serving(hostile)
    try:
        lines = pull(daemon, f"{hostile.host}/library/tok:v1")
        assert "token service" in lines[-1]["error"] and "bytes" in lines[-1]["error"], lines
        assert hostile.token_ended.wait(60)
        assert hostile.token_sent < BUFFERED_BYTES, hostile.token_sent
    finally:
        server.stop()


def test_a_file_listed_small_and_sent_huge_stops_at_its_listed_size(daemon, registry):
    registry.hf_repos["evil/bloat"] = HfRepo({"config.json": b'{"model_type": "llama"}',
                                              "model.safetensors": bytes(160 << 20)},
                                             listed={"model.safetensors": 63})
    before = store_bytes(daemon.models_dir)
    lines = pull(daemon, "hf.co/evil/bloat")
    assert "error" in lines[-1] and "63 bytes" in lines[-1]["error"], lines[-3:]
    assert store_bytes(daemon.models_dir) - before < 1 << 20
    sent = [r.sent for r in registry.requests if r.path.endswith("/model.safetensors")]
    assert sent and max(sent) < BUFFERED_BYTES, sent


def test_a_manifest_redirect_to_another_host_is_refused_and_error_pages_are_not_echoed(daemon, registry):
    elsewhere = Registry()
    server = Serving(elsewhere)
    try:
        manifest = registry.add_model("library", "moved", "v1", b"GGUF" + os.urandom(256))
        elsewhere.manifests[("library", "moved", "v1")] = json.dumps(manifest).encode()
        url = f"http://{elsewhere.host}/v2/library/moved/manifests/v1"
        registry.manifest_answers[("library", "moved", "v1")] = (302, {"Location": url}, b"")
        lines = pull(daemon, f"{registry.host}/library/moved:v1")
        assert "redirect" in lines[-1]["error"] and elsewhere.host in lines[-1]["error"], lines
        assert elsewhere.requests == []
    finally:
        server.stop()
    registry.manifest_answers[("library", "chatty", "v1")] = (404, {}, b"<html>" + b"A" * 100_000)
    [line] = pull(daemon, f"{registry.host}/library/chatty:v1")
    assert line["http_status"] == 404 and "not found" in line["error"]
    assert "A" * 300 not in line["error"] and len(line["error"]) < 600, len(line["error"])


def stream_pull(daemon, model: str):
    """POST /api/pull, its answer open: iterate it for the lines as they come."""
    return urllib.request.urlopen(urllib.request.Request(daemon.url + "/api/pull", json.dumps(
        {"model": model, "insecure": True}).encode(), method="POST"), timeout=300)


def pull_two_at_once(daemon, registry, first: str, second: str, key: str, second_ready) -> tuple[list, list]:
    """Pull ``first`` and, while its answer for ``key`` (a digest, user/repo/file) is held, ``second``,
    until one of its lines passes ``second_ready`` (it has its layers); then let both go. Their lines."""
    started = threading.Event()
    registry.on_blob = lambda k: k == key and started.set()
    registry.held[key] = gate = threading.Event()
    results = {}
    try:
        a = threading.Thread(target=lambda: results.setdefault("a", pull(daemon, first)))
        a.start()
        assert started.wait(60)
        with stream_pull(daemon, second) as answer:
            lines = []
            while not any(second_ready(line) for line in lines):
                lines.append(json.loads(answer.readline()))
            gate.set()
            lines += [json.loads(line) for line in answer]
        a.join(300)
    finally:
        registry.on_blob = None
        registry.held.pop(key).set()
    return results["a"], lines


def test_two_pulls_sharing_a_blob_share_its_download_and_leave_no_partial(daemon, registry):
    shared = os.urandom(4 << 20)
    first = registry.add_model("library", "share-a", "v1", shared, {"params": {"temperature": 0.1}})
    registry.add_model("library", "share-b", "v1", shared, {"params": {"temperature": 0.2}})
    digest = first["layers"][0]["digest"]
    a, b = pull_two_at_once(daemon, registry, f"{registry.host}/library/share-a:v1",
                            f"{registry.host}/library/share-b:v1", digest, lambda line: line.get("digest") == digest)
    assert a[-1] == {"status": "success"} and b[-1] == {"status": "success"}, (a, b)
    assert sum(r.sent for r in registry.blob_requests(digest)) == len(shared)  # fetched once
    assert not [p.name for p in (daemon.models_dir / "blobs").iterdir() if "partial" in p.name]
    names = {m["name"] for m in http("GET", daemon.url + "/api/tags")[1]["models"]}
    assert {f"{registry.host}/library/share-a:v1", f"{registry.host}/library/share-b:v1"} <= names


def test_two_names_of_one_hugging_face_commit_pulled_at_once_both_succeed(daemon, registry):
    weights = os.urandom(1 << 20)
    repo = registry.hf_repos["testuser/twin"] = HfRepo({"config.json": b'{"model_type": "llama"}',
                                                        "model.safetensors": weights})
    # the same commit under two names: the same staging folder
    a, b = pull_two_at_once(daemon, registry, "hf.co/testuser/twin", "hf.co/testuser/twin:main",
                            "testuser/twin/model.safetensors", lambda line: line.get("total") == len(weights))
    assert a[-1] == {"status": "success"} and b[-1] == {"status": "success"}, (a, b)
    assert len([r for r in registry.requests if r.path.startswith("/testuser/twin/resolve/")
                and r.path.endswith("/model.safetensors")]) == 1  # fetched once
    assert not (daemon.models_dir / ".hf-partial" / f"testuser--twin--{repo.sha}").exists()


def test_pulls_beyond_max_pulls_wait_their_turn_saying_so_then_finish(daemon, registry):
    models = [f"queue-{i}" for i in range(MAX_PULLS + 1)]
    digests = [registry.add_model("library", m, "v1", os.urandom(1 << 20))["layers"][0]["digest"] for m in models]
    downloading = threading.Semaphore(0)
    registry.on_blob = lambda d: d in digests[:MAX_PULLS] and downloading.release()
    gate = threading.Event()  # the first MAX_PULLS stay mid-blob until the last has asked
    registry.held.update({d: gate for d in digests[:MAX_PULLS]})
    results = {}
    try:
        threads = [threading.Thread(target=lambda m=m: results.setdefault(m, pull(daemon, f"{registry.host}/library/{m}:v1")))
                   for m in models[:MAX_PULLS]]
        for t in threads:
            t.start()
        for _ in range(MAX_PULLS):
            assert downloading.acquire(timeout=60)
        with stream_pull(daemon, f"{registry.host}/library/{models[-1]}:v1") as answer:
            first = json.loads(answer.readline())
            gate.set()
            rest = [json.loads(line) for line in answer]
        for t in threads:
            t.join(300)
    finally:
        registry.on_blob = None
        gate.set()
        for d in digests:
            registry.held.pop(d, None)
    assert first["status"].startswith("queued") and f"max_pulls {MAX_PULLS}" in first["status"], first
    assert rest[-1] == {"status": "success"}, rest[-3:]
    assert all(results[m][-1] == {"status": "success"} for m in models[:MAX_PULLS]), results
