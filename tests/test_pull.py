"""Pulls into gpushare's store from a registry served on 127.0.0.1 by the test (catalog/pull.py in-process):
names, parallel ranges, a cut connection and a restart resumed with Range, a digest mismatch, the disk
space check, a full disk, bad manifests, the token flow, shared pulls."""

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gpushare.catalog import blob_download, blob_store
from gpushare.catalog.names import BadName, parse_name
from gpushare.catalog.pull import Pull, PullError, Pulls, run_pull
from gpushare.catalog.ollama_store import scan_store
from registry_fixture import Registry, Serving

BLOB_BYTES = 3 << 20


@pytest.fixture
def registry():
    reg = Registry()
    serving = Serving(reg)
    yield reg
    serving.stop()


def blob(seed: int, size: int = BLOB_BYTES) -> bytes:
    return b"GGUF" + bytes((i * 7 + seed) % 251 for i in range(size - 4))


def pull(registry: Registry, root: Path, name: str = "library/tiny:q4"):
    p = Pull(parse_name(f"{registry.host}/{name}", insecure=True))
    asyncio.run(run_pull(p, root))
    return p


def files_under(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")} if path.exists() else set()


def test_names_resolve_as_ollama_and_huggingface_do():
    env = {}
    n = parse_name("smollm2", env=env)
    assert (n.host, n.namespace, n.model, n.tag, n.base_url) == ("registry.ollama.ai", "library", "smollm2",
                                                                 "latest", "https://registry.ollama.ai")
    assert n.display == "smollm2:latest"
    n = parse_name("someone/model:7b", env=env)
    assert n.parts == ("registry.ollama.ai", "someone", "model", "7b") and n.display == "someone/model:7b"
    n = parse_name("127.0.0.1:5000/team/model:v1", env=env)
    assert n.base_url == "https://127.0.0.1:5000" and n.display == "127.0.0.1:5000/team/model:v1"
    assert parse_name("127.0.0.1:5000/team/model:v1", insecure=True, env=env).base_url == "http://127.0.0.1:5000"
    n = parse_name("hf.co/bartowski/SmolLM2-GGUF:Q4_K_M", env={"HF_ENDPOINT": "http://127.0.0.1:9/", "HF_TOKEN": "t"})
    assert (n.base_url, n.repository, n.tag, n.token) == ("http://127.0.0.1:9", "bartowski/SmolLM2-GGUF", "Q4_K_M", "t")
    assert parse_name("huggingface.co/a/b", env=env).base_url == "https://huggingface.co"
    for bad in ("../x", "a/../b:c", "a/b/c/d", "x:../y", "/abs", "host/ns/..", "", "m@sha256:00"):
        with pytest.raises(BadName):
            parse_name(bad, env=env)


def test_a_pull_lands_in_the_store_in_parallel_ranges_and_lists(registry, tmp_path, monkeypatch):
    monkeypatch.setattr(blob_download, "PART_MIN_BYTES", 256 << 10)  # 12 parts' worth: MAX_PARTS ranges
    data = blob(1)
    registry.add_model("library", "tiny", "q4", data, {"params": {"temperature": 0.2}, "system": "Be brief."})
    p = pull(registry, tmp_path)
    assert p.status == "success" and all(layer.completed == layer.total for layer in p.layers)
    digest = json.loads(registry.manifests[("library", "tiny", "q4")])["layers"][0]["digest"]
    seen = registry.blob_requests(digest)
    starts = sorted(int(r.range.removeprefix("bytes=").split("-")[0]) for r in seen)
    assert len(seen) == blob_download.MAX_PARTS and starts == [i * len(data) // 8 for i in range(8)]
    assert sum(r.sent for r in seen) == len(data)
    assert (tmp_path / "blobs" / digest.replace(":", "-")).read_bytes() == data
    [(name, _, path, sha, preset, adapter)] = scan_store(tmp_path)
    assert name == f"{registry.host}/library/tiny:q4" and sha == digest[7:]
    assert preset.options == {"temperature": 0.2} and preset.system == "Be brief." and adapter is None
    assert not [f for f in files_under(tmp_path) if "partial" in f]


def test_a_cut_connection_resumes_with_range_and_bytes_are_not_sent_twice(registry, tmp_path):
    data = blob(2)
    manifest = registry.add_model("library", "tiny", "q4", data)
    digest = manifest["layers"][0]["digest"]
    registry.cut_after[digest] = 1_000_000
    pull(registry, tmp_path)
    seen = registry.blob_requests(digest)
    assert [r.range for r in seen] == [f"bytes=0-{len(data) - 1}", f"bytes=1000000-{len(data) - 1}"]
    assert [r.sent for r in seen] == [1_000_000, len(data) - 1_000_000]
    assert blob_store.blob_path(tmp_path, digest).read_bytes() == data


def test_a_pull_that_gave_up_resumes_where_it_stopped_after_a_restart(registry, tmp_path, monkeypatch):
    data = blob(3)
    manifest = registry.add_model("library", "tiny", "q4", data)
    digest = manifest["layers"][0]["digest"]
    monkeypatch.setattr(blob_download, "MAX_RETRIES", 0)
    registry.cut_after[digest] = 2_000_000
    with pytest.raises(PullError, match="gave up after 0 retries"):
        pull(registry, tmp_path)
    assert blob_store.read_partial(tmp_path, digest, len(data)).written == 2_000_000
    assert not (tmp_path / "manifests").exists()
    pull(registry, tmp_path)  # a new process would read the same partial state
    assert registry.blob_requests(digest)[-1].range == f"bytes=2000000-{len(data) - 1}"
    assert registry.blob_requests(digest)[-1].sent == len(data) - 2_000_000
    assert blob_store.blob_path(tmp_path, digest).read_bytes() == data


def test_a_blob_that_does_not_match_its_digest_is_refused_and_nothing_is_kept(registry, tmp_path):
    manifest = registry.add_model("library", "tiny", "q4", blob(4))
    registry.corrupt.add(manifest["layers"][0]["digest"])
    with pytest.raises(PullError, match="arrived with SHA-256 .*nothing of it was kept"):
        pull(registry, tmp_path)
    assert not [f for f in files_under(tmp_path / "blobs") if manifest["layers"][0]["digest"][7:] in f]
    assert not (tmp_path / "manifests").exists() and scan_store(tmp_path) == []


def test_too_little_disk_is_refused_before_a_byte_naming_needed_and_free(registry, tmp_path):
    data = blob(5, 1 << 20)
    doc = registry.add_model("library", "huge", "q4", data)
    doc["layers"][0]["size"] = 10 ** 15
    registry.manifests[("library", "huge", "q4")] = json.dumps(doc).encode()
    needed = 10 ** 15 + doc["config"]["size"]
    with pytest.raises(PullError, match=rf"not enough disk space .* needs {needed} bytes .* \(.*\) are free") as e:
        pull(registry, tmp_path, "library/huge:q4")
    assert e.value.status == 400
    assert not registry.blob_requests(doc["layers"][0]["digest"]) and files_under(tmp_path / "blobs") == set()


@pytest.mark.parametrize("digest", ["sha256:../../../../outside", "/etc/passwd", "sha256:" + "A" * 64, 7])
def test_a_manifest_with_a_path_for_a_digest_is_refused_and_writes_nothing(registry, tmp_path, digest):
    doc = registry.add_model("library", "bad", "q4", blob(6, 4096))
    doc["layers"][0]["digest"] = digest
    registry.manifests[("library", "bad", "q4")] = json.dumps(doc).encode()
    root = tmp_path / "store"
    with pytest.raises(PullError, match="invalid digest"):
        pull(registry, root, "library/bad:q4")
    assert files_under(tmp_path) <= {"store"}


def test_an_adapter_layer_is_pulled_and_lists_as_the_adapter_on_the_model_layer(registry, tmp_path):
    registry.add_model("library", "lora", "q4", blob(8, 4096), {"adapter": b"GGUF lora bytes"})
    assert pull(registry, tmp_path, "library/lora:q4").status == "success"
    [(name, _, path, _, _, adapter)] = scan_store(tmp_path)
    assert name == f"{registry.host}/library/lora:q4" and open(adapter, "rb").read() == b"GGUF lora bytes"
    assert open(path, "rb").read() == blob(8, 4096)


def test_a_huge_manifest_and_refused_layers_are_named(registry, tmp_path):
    registry.manifests[("library", "big", "q4")] = b'{"layers": [' + b" " * (100 << 20) + b"]}"
    with pytest.raises(PullError, match="over the 4194304 bytes a manifest may be"):
        pull(registry, tmp_path, "library/big:q4")
    registry.add_model("library", "vision", "q4", blob(7, 4096), {"projector": b"mmproj"})
    with pytest.raises(PullError, match=r"vision projector \(mmproj\) layer.*application/vnd.ollama.image.projector"):
        pull(registry, tmp_path, "library/vision:q4")
    with pytest.raises(PullError, match=r'model ".*library/nothing:here" not found: .* answered 404') as e:
        pull(registry, tmp_path, "library/nothing:here")
    assert e.value.status == 404
    assert files_under(tmp_path / "blobs") == set() and not (tmp_path / "manifests").exists()


def test_the_registry_token_flow(registry, tmp_path):
    registry.token = "t0ken"
    manifest = registry.add_model("library", "tiny", "q4", blob(9, 8192))
    pull(registry, tmp_path)
    manifest_requests = [r for r in registry.requests if "/manifests/" in r.path]
    assert [r.authorization for r in manifest_requests] == [None, "Bearer t0ken"]
    assert all(r.authorization == "Bearer t0ken" for r in registry.blob_requests(manifest["layers"][0]["digest"]))


def test_two_pulls_of_one_name_share_one_download(registry, tmp_path):
    manifest = registry.add_model("library", "tiny", "q4", blob(10))

    async def both():
        pulls = Pulls(lambda: tmp_path)
        name = parse_name(f"{registry.host}/library/tiny:q4", insecure=True)
        first, second = pulls.start(name), pulls.start(name)
        assert first is second
        await first.task
        assert pulls.get(name) is None

    asyncio.run(both())
    assert len(registry.blob_requests(manifest["layers"][0]["digest"])) == 1


def test_a_cancelled_pull_stops_writing_at_once_and_the_next_one_resumes(registry, tmp_path):
    """The ranges run in a low-priority process of their own: cancelling the pull (a daemon
    stopping) must end them there too, the partial state saved, before the cancel returns."""
    data = blob(12)
    digest = registry.add_model("library", "tiny", "q4", data)["layers"][0]["digest"]
    registry.bytes_per_s = 2 << 20  # ~1.5 s for the blob: the cancel lands mid-way

    async def cancelled_mid_blob():
        p = Pull(parse_name(f"{registry.host}/library/tiny:q4", insecure=True))
        task = asyncio.ensure_future(run_pull(p, tmp_path))
        while not [layer for layer in p.layers if layer.digest == digest and layer.completed >= 512 << 10]:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return sum(r.sent for r in registry.blob_requests(digest))

    sent_at_cancel = asyncio.run(cancelled_mid_blob())
    written = blob_store.read_partial(tmp_path, digest, len(data)).written
    assert 512 << 10 <= written < len(data)
    asyncio.run(asyncio.sleep(1.2))  # a range still running in its thread would go on (and save, every 1 s)
    assert blob_store.read_partial(tmp_path, digest, len(data)).written == written
    assert sum(r.sent for r in registry.blob_requests(digest)) <= sent_at_cancel + (256 << 10)
    registry.bytes_per_s = None
    pull(registry, tmp_path)
    resumed = registry.blob_requests(digest)[-1]
    assert resumed.range == f"bytes={written}-{len(data) - 1}" and resumed.sent == len(data) - written
    assert blob_store.blob_path(tmp_path, digest).read_bytes() == data


PULL_IN_A_PROCESS = """
import asyncio, sys
from pathlib import Path
from gpushare.catalog.names import parse_name
from gpushare.catalog.pull import Pull, run_pull
asyncio.run(run_pull(Pull(parse_name(sys.argv[1], insecure=True)), Path(sys.argv[2])))
"""


def test_the_download_runs_at_nice_19_apart_from_the_daemon_and_ends_when_the_daemon_is_killed(registry, tmp_path):
    """A download in the daemon's own process made its chats' TTFT 1.5x (benchmarks/pull_ttft.py):
    it runs in a child at the lowest priority, which must not outlive a daemon killed with SIGKILL."""
    data = blob(13)
    digest = registry.add_model("library", "tiny", "q4", data)["layers"][0]["digest"]
    registry.bytes_per_s = 1 << 20  # ~3 s for the blob: the kill lands mid-way
    daemon = subprocess.Popen([sys.executable, "-c", PULL_IN_A_PROCESS, f"{registry.host}/library/tiny:q4",
                               str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while sum(r.sent for r in registry.blob_requests(digest)) < 512 << 10:
            assert time.monotonic() < deadline and daemon.poll() is None
            time.sleep(0.02)
        [child] = psutil.Process(daemon.pid).children()
        assert "gpushare.catalog.pull_child" in child.cmdline() and child.nice() == 19
    finally:
        daemon.kill()
        daemon.wait()
    child.wait(timeout=10)  # it saw its stdin close and stopped
    sent_at_end = sum(r.sent for r in registry.blob_requests(digest))
    time.sleep(1.2)
    assert sum(r.sent for r in registry.blob_requests(digest)) == sent_at_end < len(data)
    registry.bytes_per_s = None
    pull(registry, tmp_path)
    assert blob_store.blob_path(tmp_path, digest).read_bytes() == data


def test_a_full_disk_ends_the_pull_and_leaves_no_partial(registry, tmp_path, monkeypatch):
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        monkeypatch.setattr(blob_store, "DISK_MARGIN_BYTES", 0)
        manifest = registry.add_model("library", "tiny", "q4", blob(11, 6 << 20))
        digest = manifest["layers"][0]["digest"]

        def fill(seen_digest):  # after the space check passed: something else takes the disk
            if seen_digest == digest and not (mount / "filler").exists():
                free = os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize
                (mount / "filler").write_bytes(b"\0" * (free - (1 << 20)))

        registry.on_blob = fill
        with pytest.raises(PullError, match="is full"):
            pull(registry, mount)
        assert not [f for f in files_under(mount) if "partial" in f or f.startswith("manifests/")]
    finally:
        subprocess.run(["umount", str(mount)], check=True)
