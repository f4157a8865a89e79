"""The daemon's supervisor never loads torch or numpy (engine.isolation: process, the default).

Engines and their torch live in the worker processes; the supervisor (HTTP, tokenising, chat
templates, JSON schemas, the registry, placement) must not pay torch's ~200 MiB of resident memory:
with it the idle daemon held 2.6x llama-server's memory (benchmarks/memory.py). Nor numpy's and the
`gguf` package's ~22 MiB: it reads GGUF headers with catalog/gguf_reader.py alone.
"""

import subprocess
import sys

import pytest
from daemon_fixture import MODEL, http, serving
from test_import_rule import SUPERVISOR, package_modules, package_of

SUPERVISOR_RSS_LIMIT_BYTES = 160 << 20  # measured 91 MiB after these requests; 272 MiB with torch loaded
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def test_the_supervisor_packages_import_without_torch():
    """Every module of the supervisor's packages and of the protocol (tests/test_import_rule.py reads
    their imports) imported in one process: no torch, numpy or gguf module, and no libtorch mapped."""
    names = sorted(n for n in package_modules() if package_of(n) in (*SUPERVISOR, "protocol"))
    code = ("import importlib, sys\n"
            "import gpushare.api, gpushare.residency, gpushare.catalog, gpushare.cli\n"
            f"for name in {names!r}:\n    importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m in ('torch', 'numpy', 'gguf')\n"
            "             or m.startswith(('torch.', 'numpy.', 'gguf.', 'llguidance.torch'))),\n"
            "      'libtorch' in open('/proc/self/maps').read())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[] False", out.stdout + out.stderr


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_path):
    with serving(tmp_path_factory.mktemp("torch_free"), smollm2_path) as d:
        yield d


def mapped_libraries(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[-1].rsplit("/", 1)[-1] for line in f if "/" in line}


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def mapped_paths(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[-1] for line in f if "/" in line}


def test_libraries_for_grammars_and_templates_load_only_where_used(daemon):
    """A plain chat leaves llguidance out of both processes, and Jinja2 (markupsafe) and the gguf
    package (sentencepiece) out of the engine worker, which renders no template and decodes SmolLM2's
    GGUF types itself: ~11 MiB of the idle daemon's resident memory. The first JSON schema loads
    llguidance, in the supervisor (its check) and the worker (its matcher)."""
    url = daemon.url
    status, body, _ = http("POST", url + "/api/chat", {"model": MODEL, "stream": False, "options": {"num_predict": 4},
                                                       "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200, body
    worker_pid = daemon.loaded()[MODEL]["worker_pid"]

    def loaded(pid: int, package: str) -> bool:
        return any(f"/{package}/" in path for path in mapped_paths(pid))

    assert not loaded(worker_pid, "llguidance") and not loaded(worker_pid, "markupsafe")
    assert not loaded(worker_pid, "sentencepiece")
    assert not loaded(daemon.proc.pid, "llguidance")
    status, body, _ = http("POST", url + "/api/chat", {"model": MODEL, "stream": False, "format": PERSON,
                                                       "messages": [{"role": "user", "content": "A person?"}],
                                                       "options": {"temperature": 0, "num_predict": 40}})
    assert status == 200, body
    assert loaded(worker_pid, "llguidance") and loaded(daemon.proc.pid, "llguidance")


def test_a_serving_supervisor_maps_no_torch(daemon):
    """After answers with logprobs, a JSON schema, embeddings, an OpenAI chat and /api/show have
    crossed the supervisor, it still maps no libtorch; its engine worker does."""
    url = daemon.url
    greedy = {"temperature": 0, "num_predict": 8}
    status, body, _ = http("POST", url + "/api/generate", {"model": MODEL, "prompt": "Hi", "stream": False,
                                                           "logprobs": True, "top_logprobs": 2, "options": greedy})
    assert status == 200 and body["logprobs"], body
    status, body, _ = http("POST", url + "/api/chat", {"model": MODEL, "stream": False, "format": PERSON,
                                                       "messages": [{"role": "user", "content": "A person?"}],
                                                       "options": {"temperature": 0, "num_predict": 40}})
    assert status == 200, body
    status, body, _ = http("POST", url + "/api/embed", {"model": MODEL, "input": ["a cat", "a dog"]})
    assert status == 200 and len(body["embeddings"]) == 2, body
    status, body, _ = http("POST", url + "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "logprobs": True})
    assert status == 200, body
    assert http("POST", url + "/api/show", {"model": MODEL, "verbose": True})[0] == 200

    supervisor = mapped_libraries(daemon.proc.pid)
    assert not {lib for lib in supervisor if lib.startswith(("libtorch", "_multiarray_umath"))}, sorted(supervisor)
    worker_pid = daemon.loaded()[MODEL]["worker_pid"]
    worker = mapped_libraries(worker_pid)
    assert any(lib.startswith("libtorch") for lib in worker) and any(lib.startswith("_multiarray_umath") for lib in worker)
    assert rss_bytes(daemon.proc.pid) < SUPERVISOR_RSS_LIMIT_BYTES
