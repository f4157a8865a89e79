"""Soak: streaming requests for ten minutes, a third dropped mid-stream, a tenth hostile; does anything
leak, does anything stall?

Starts `gpushare serve` on a free loopback port (one model and a copy of it whose chat template never
ends, tenants on), warms it up, notes the daemon's RSS and the greedy answers to a few probe
prompts, then sends streaming chats for `--duration-s` (600), `--concurrency` (8) at a time, seeded:
- a third are dropped after a random number of chunks (the client closes the connection);
- a tenth are hostile and must get a 4xx: bad sampling values, keep_alive "nan" or "1ms", too many
  stop strings or messages, nested JSON, a foreign Origin, a browser's text/plain body, and the
  attacks on the event loop (issue 34): 3,000 tools, a schema of 20,000 properties, a 64 MiB body
  of nested empty objects, token-id prompts of 400,000 and 150,000 ids, the never-ending template (waited for, or
  left after half a second);
- the rest read their stream to the end;
- with `--burst-every-s`, every so often `--burst-size` (512) plain streaming chats more are sent at
  once (issue 67): each must be answered in full, none refused (the config's bounds hold 1,024).
Meanwhile a poller asks /api/version every 20 ms: its slowest answer is the longest stall.
Afterwards: no KV block may stay held, RSS (the daemon's and its engine workers', each time once
the idle models have given their KV slabs back; the template children, a pool of at most four
that are killed and replaced, are shown apart) must not grow by more than `--rss-tolerance` (5%)
from its value after warm-up (`--warmup` requests, then each attack on the event loop once), no poll may have
taken over `--max-stall-s` (0.25; less the daemon's waits for a CPU, see POLLER), and every
probe's greedy answer must equal the one before. Exit status 1 when a check fails.

    python benchmarks/soak.py                           # ten minutes and about two more
    python benchmarks/soak.py --duration-s 60 --json-out soak.json
    python benchmarks/soak.py --burst-every-s 60            # and a burst of 512 every minute
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tenants import parse_with_model, prompt_of, start_daemon  # noqa: E402

WORK_TIMEOUT = "3s"  # limits.work_timeout: how long the never-ending template renders before its 400
SLOW_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
MAX_TEMPLATE_CHILDREN = 4  # api/work.WORK_THREADS: one child per thread at most
KEY = "soak-key"
ADMIN_KEY = "soak-admin-key"
START_TIMEOUT_S = 300
IDLE_RELEASE_WAIT_S = 60  # the engine gives an idle model's KV back after 30 s
PROBES = ["Why is the sky blue?", "Name three fruits.", "What is two plus two?"]
HOSTILE = [
    lambda body: ({**body, "repetition_penalty": 1e-40}, {}),
    lambda body: ({**body, "temperature": 1e30}, {}),
    lambda body: ({**body, "seed": 2 ** 70}, {}),
    lambda body: ({**body, "stop": [str(i) for i in range(1000)]}, {}),
    lambda body: ({**body, "messages": body["messages"] * 5000}, {}),
    lambda body: (body, {"Origin": "https://evil.example"}),
    lambda body: (body, {"Origin": "http://localhost:3000", "Content-Type": "text/plain"}),
    lambda body: ('{"model": "bench", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}", {}),
]
HOSTILE_OLLAMA = [{"model": "bench", "keep_alive": "nan"}, {"model": "bench", "keep_alive": "1ms"}]


def loop_attacks() -> list[tuple[str, str, bytes, float | None]]:
    """(name, path, body, seconds after which the client leaves or None): issue 34's attacks, built once."""
    def chat(**extra) -> bytes:
        return json.dumps({"model": "bench", "messages": [{"role": "user", "content": "Hi"}], **extra}).encode()

    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}}}} for i in range(3000)]
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20000)}}
    head, item = chat()[:-1] + b', "x": [', b'{"a":{}},'
    nested = head + item * ((64 * 2**20 - len(head) - 16) // len(item)) + b'{"a":{}}]}'
    slow = json.dumps({"model": "slow", "messages": [{"role": "user", "content": "Hi"}]}).encode()
    return [("3000_tools", "/v1/chat/completions", chat(tools=tools, tool_choice="required"), None),
            ("20000_property_schema", "/v1/chat/completions",
             chat(response_format={"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}), None),
            ("64_mib_nested_objects", "/api/chat", nested, None),
            ("400000_token_ids", "/v1/completions",
             json.dumps({"model": "bench", "prompt": [1] * 400_000}).encode(), None),
            ("150000_token_ids", "/v1/completions",  # parsed (under limits.max_json_items), then refused
             json.dumps({"model": "bench", "prompt": [1] * 150_000}).encode(), None),
            ("never_ending_template", "/api/chat", slow, None),
            ("never_ending_template_left", "/api/chat", slow, 0.5)]


def daemon_config(args, port: int, models_dir: Path) -> dict:
    return {
        "server": {"host": f"127.0.0.1:{port}", "drain_timeout": "2s", "max_queued": 1024},
        "models": [{"name": "bench", "path": args.model_path, "preload": True, "keep_alive": -1}],
        "models_dir": str(models_dir),
        "engine": {"device": args.device, "max_num_seqs": args.concurrency},
        "memory": {"kv_budget": "512MiB", "max_loaded_models": 2},
        "limits": {"work_timeout": WORK_TIMEOUT},
        "tenants": [{"name": "soak", "api_keys": [KEY]}, {"name": "admin", "api_keys": [ADMIN_KEY], "admin": True}],
    }


def chat_body(i: int, tokens: int) -> dict:
    return {"model": "bench", "messages": [{"role": "user", "content": prompt_of(i)}], "max_tokens": tokens,
            "temperature": 0, "stream": True}


def is_template_child(p: psutil.Process) -> bool:
    try:
        return "gpushare.catalog.template_child" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def tree_rss(pid: int) -> tuple[int, int, int]:
    """(RSS of the daemon and its engine workers (the model and the KV pool live in the workers), RSS of
    its template children, how many of those there are)."""
    daemon = psutil.Process(pid)
    main, children, count = daemon.memory_info().rss, 0, 0
    for p in daemon.children(recursive=True):
        try:
            rss = p.memory_info().rss
        except psutil.Error:  # a template child killed meanwhile
            continue
        if is_template_child(p):
            children, count = children + rss, count + 1
        else:
            main += rss
    return main, children, count


# The poller is a process of its own, so that this one's work (sending 64 MiB bodies, reading eight
# streams) does not delay it: what it measures is the daemon. It asks /api/version every 20 ms over
# one connection until its stdin closes, then prints the slowest answer and the slow ones (their
# start on the monotonic clock, which every process shares, and how long they took). As in
# tests/test_loop_bounds.py, an answer's time is counted less the time the daemon's event-loop
# thread and the poller were runnable but waiting for a CPU (/proc/<tid>/schedstat), which on a
# shared machine is other work's; "longest_raw_s" is the slowest answer as the client saw it.
POLLER = """
import http.client, json, sys, threading, time
conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=60)
bound_s, daemon_pid, stop = float(sys.argv[2]), int(sys.argv[3]), threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
result = {"longest_s": 0.0, "longest_raw_s": 0.0, "polls": 0, "failed": 0, "slow": []}

def queued_s():
    paths = (f"/proc/{daemon_pid}/task/{daemon_pid}/schedstat", "/proc/thread-self/schedstat")
    return sum(int(open(path).read().split()[1]) for path in paths) / 1e9

while not stop.is_set():
    queued, started = queued_s(), time.monotonic()
    conn.request("GET", "/api/version")
    resp = conn.getresponse()
    resp.read()
    raw_s = time.monotonic() - started
    took = raw_s - (queued_s() - queued)
    result["longest_raw_s"] = max(result["longest_raw_s"], raw_s)
    result["longest_s"], result["polls"] = max(result["longest_s"], took), result["polls"] + 1
    result["failed"] += resp.status != 200
    if took > bound_s:
        result["slow"].append([started, took])
    time.sleep(0.02)
print(json.dumps(result))
"""


def start_poller(base_url: str, bound_s: float, daemon_pid: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", POLLER, base_url.rsplit(":", 1)[1], str(bound_s), str(daemon_pid)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def poller_result(poller: subprocess.Popen, t0: float, bound_s: float) -> dict:
    result = json.loads(poller.communicate("", timeout=120)[0])
    slow = [[round(started - t0, 3), round(took, 3)] for started, took in result.pop("slow")]
    return {**result, "over": len(slow), "slow_polls": slow, "bound_s": bound_s}


async def idle_rss(session: aiohttp.ClientSession, base_url: str, pid: int) -> tuple[int, int, int]:
    """``tree_rss`` once the idle model has given its KV slabs back (the engine does after 30 s idle):
    the prefix cache keeps finished prompts' blocks meanwhile, by design, and those pages would count."""
    deadline = time.monotonic() + IDLE_RELEASE_WAIT_S
    while time.monotonic() < deadline:
        async with session.get(base_url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as resp:
            text = await resp.text()
        committed = [float(line.split()[-1]) for line in text.splitlines()
                     if line.startswith(("gpushare_kv_pool_committed_bytes ", "gpushare_kv_pool_committed_bytes{"))]
        if committed and not any(committed):
            break
        await asyncio.sleep(1)
    return tree_rss(pid)


async def ps(session: aiohttp.ClientSession, base_url: str) -> dict:
    async with session.get(base_url + "/api/ps", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as resp:
        return await resp.json()


async def greedy_answer(session: aiohttp.ClientSession, base_url: str, prompt: str) -> str:
    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0}
    async with session.post(base_url + "/v1/chat/completions", json=body) as resp:
        return (await resp.json())["choices"][0]["message"]["content"]


async def loop_attack(session, base_url: str, attack, counts: dict) -> None:
    """One of ``loop_attacks``; counted as refused when its 4xx names the limit (or, for one left by its
    client, when nothing came back before it left); noted in ``counts["attacks"]`` as [start s, name,
    seconds, status]."""
    name, path, data, leave_after_s = attack
    started = time.monotonic()
    request = session.post(base_url + path, data=data, headers={"Content-Type": "application/json"})
    if leave_after_s is not None:
        try:
            async with await asyncio.wait_for(request, leave_after_s) as resp:  # answered before the client left
                status, good = resp.status, False
        except asyncio.TimeoutError:  # the template is still rendering: the client leaves
            status, good = "left", True
    else:
        async with request as resp:
            body = await resp.read()
            # The 4xx names the limit: a limits.* key, or the model's context for a token-id prompt too long.
            status, good = resp.status, 400 <= resp.status < 500 and (b"limits." in body or b"usable context" in body)
    counts["hostile_4xx" if good else "hostile_other"] += 1
    counts["attacks"].append([round(started - counts["t0"], 3), name, round(time.monotonic() - started, 3), status])


async def one_request(session, base_url: str, i: int, rng: random.Random, args, counts: dict,
                      attacks: list) -> None:
    body = chat_body(i, args.tokens)
    if rng.random() < 0.1:
        kind = rng.randrange(len(HOSTILE) + len(HOSTILE_OLLAMA) + len(attacks))
        if kind >= len(HOSTILE) + len(HOSTILE_OLLAMA):
            await loop_attack(session, base_url, attacks[kind - len(HOSTILE) - len(HOSTILE_OLLAMA)], counts)
            return
        if kind >= len(HOSTILE):
            path, payload, headers = "/api/generate", HOSTILE_OLLAMA[kind - len(HOSTILE)], {}
        else:
            path, (payload, headers) = "/v1/chat/completions", HOSTILE[kind](body)
        data = payload if isinstance(payload, str) else json.dumps(payload)
        headers = {"Content-Type": "application/json", **headers}
        started = time.monotonic()
        async with session.post(base_url + path, data=data, headers=headers) as resp:
            await resp.read()
            counts["hostile_4xx" if 400 <= resp.status < 500 else "hostile_other"] += 1
        counts["attacks"].append([round(started - counts["t0"], 3), f"hostile[{kind}]",
                                  round(time.monotonic() - started, 3), resp.status])
        return
    drop_after = rng.randint(1, args.tokens) if rng.random() < 1 / 3 else None
    async with session.post(base_url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            counts["failed"] += 1
            return
        chunks = 0
        async for line in resp.content:
            if line.startswith(b"data: {"):
                chunks += 1
                if b'"error"' in line:
                    counts["failed"] += 1
                    return
                if drop_after is not None and chunks >= drop_after:
                    resp.close()  # the client goes away mid-stream
                    counts["dropped"] += 1
                    return
        counts["completed"] += 1


async def bursts(base_url: str, args, counts: dict, started: float) -> None:
    """Every --burst-every-s until the run's end, --burst-size plain streaming chats at once, each read to
    its end: counted as burst_completed, burst_refused (not 200) or burst_lost (a stream that broke)."""
    connector = aiohttp.TCPConnector(limit=0)  # all at once: no cap of the client's own
    async with aiohttp.ClientSession(connector=connector, headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def one(i: int) -> str:
            try:
                async with session.post(base_url + "/v1/chat/completions", json=chat_body(i, args.tokens)) as resp:
                    if resp.status != 200:
                        await resp.read()
                        return "burst_refused"
                    async for line in resp.content:
                        if line.strip() == b"data: [DONE]":
                            return "burst_completed"
                    return "burst_lost"
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return "burst_lost"

        first = 1_000_000  # prompts of their own, not the steady traffic's
        while time.monotonic() - started + args.burst_every_s < args.duration_s:
            await asyncio.sleep(args.burst_every_s)
            for outcome in await asyncio.gather(*(one(first + k) for k in range(args.burst_size))):
                counts[outcome] += 1
            first += args.burst_size


async def add_slow_model(session: aiohttp.ClientSession, base_url: str) -> None:
    """"slow": bench with the never-ending template, created and loaded for good by the admin."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with session.post(base_url + "/api/create", headers=admin, json={
            "model": "slow", "from": "bench", "template": SLOW_TEMPLATE, "stream": False}) as resp:
        assert resp.status == 200, await resp.text()
    async with session.post(base_url + "/api/generate", headers=admin,
                            json={"model": "slow", "keep_alive": -1}) as resp:
        assert resp.status == 200, await resp.text()


async def wait_started(proc, session: aiohttp.ClientSession, base_url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the daemon did not start:\n{log.read_text()[-3000:]}")
        try:
            if (await ps(session, base_url)).get("models"):
                return
        except (aiohttp.ClientError, ValueError):
            pass
        await asyncio.sleep(0.5)


async def run(args) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="gpushare-soak-"))
    (workdir / "models").mkdir()
    proc, base_url, log = start_daemon(lambda port, models_dir: daemon_config(args, port, models_dir), workdir)
    session = aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"},
                                    timeout=aiohttp.ClientTimeout(total=600))
    attacks = loop_attacks()
    t0, poller = time.monotonic(), None
    try:
        await wait_started(proc, session, base_url, log)
        await add_slow_model(session, base_url)
        rng = random.Random(args.seed)
        counts = dict.fromkeys(("completed", "dropped", "hostile_4xx", "hostile_other", "failed", "burst_completed",
                                "burst_refused", "burst_lost"), 0)
        warm = {**counts, "attacks": [], "t0": t0}
        counts.update(attacks=[], t0=t0)
        for i in range(args.warmup):
            await one_request(session, base_url, -1 - i, rng, args, warm, attacks)
        for attack in attacks:  # each once: the allocator's high-water mark for them belongs to the baseline
            await loop_attack(session, base_url, attack, warm)
        probes_before = [await greedy_answer(session, base_url, p) for p in PROBES]
        rss_warm = await idle_rss(session, base_url, proc.pid)
        poller = start_poller(base_url, args.max_stall_s, proc.pid)
        started = time.monotonic()
        sent = iter(range(args.requests) if args.requests else itertools.count())

        async def worker() -> None:
            for i in sent:
                if time.monotonic() - started >= args.duration_s:
                    return
                await one_request(session, base_url, i, rng, args, counts, attacks)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)),
                             *([bursts(base_url, args, counts, started)] if args.burst_every_s else []))
        elapsed_s = time.monotonic() - started
        stalls = poller_result(poller, t0, args.max_stall_s)
        held = None
        for _ in range(60):  # cancelled requests free their blocks within an engine step
            held = sum(m["kv_blocks_used"] for m in (await ps(session, base_url))["models"])
            if held == 0:
                break
            await asyncio.sleep(0.5)
        rss_after = await idle_rss(session, base_url, proc.pid)
        probes_after = [await greedy_answer(session, base_url, p) for p in PROBES]
    finally:
        if poller is not None and poller.poll() is None:  # the run failed before reading it
            poller.kill()
        await session.close()
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(workdir, ignore_errors=True)  # its config and the daemon's log (a failure quotes the log)
    rss_ratio = rss_after[0] / rss_warm[0]
    return {"config": vars(args), "counts": counts, "elapsed_s": elapsed_s, "kv_blocks_held_after": held,
            "rss_warm_bytes": rss_warm[0], "rss_after_bytes": rss_after[0], "rss_ratio": rss_ratio,
            "template_children_warm": rss_warm[1:], "template_children_after": rss_after[1:],
            "stalls": stalls, "probes_exact": probes_before == probes_after,
            # A leak grows; RSS can also shrink (the kernel reclaims file-backed pages of the weights).
            "passed": held == 0 and rss_ratio - 1 <= args.rss_tolerance and probes_before == probes_after
            and counts["failed"] == 0 and counts["hostile_other"] == 0 and stalls["over"] == 0
            and counts["burst_refused"] == 0 and counts["burst_lost"] == 0
            and stalls["failed"] == 0 and rss_after[2] <= MAX_TEMPLATE_CHILDREN}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", help="GGUF file or HF folder (default: the bundled SmolLM2-135M)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--duration-s", type=float, default=600, help="send requests for this long (default 600)")
    p.add_argument("--requests", type=int, default=0, help="stop after this many requests too (default: no bound)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16, help="max_tokens of each request")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--rss-tolerance", type=float, default=0.05)
    p.add_argument("--max-stall-s", type=float, default=0.25, help="the slowest /api/version answer allowed")
    p.add_argument("--burst-every-s", type=float, default=0, help="a burst this often (default 0: none)")
    p.add_argument("--burst-size", type=int, default=512, help="chats sent at once in each burst")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", help="also write the result as JSON here")
    args = parse_with_model(p, argv)
    result = asyncio.run(run(args))
    c = result["counts"]
    total = sum(c[k] for k in ("completed", "dropped", "hostile_4xx", "hostile_other", "failed"))
    print(f"{total} requests in {result['elapsed_s']:.0f}s: {c['completed']} completed, "
          f"{c['dropped']} dropped mid-stream, {c['hostile_4xx']} hostile refused with 4xx "
          f"({c['hostile_other']} otherwise), {c['failed']} failed")
    if args.burst_every_s:
        print(f"bursts of {args.burst_size}: {c['burst_completed']} answered in full, {c['burst_refused']} refused, "
              f"{c['burst_lost']} lost")
    print(f"KV blocks held afterwards: {result['kv_blocks_held_after']}; RSS {result['rss_warm_bytes'] / 2**20:.0f} "
          f"-> {result['rss_after_bytes'] / 2**20:.0f} MiB ({(result['rss_ratio'] - 1) * 100:+.1f}%); "
          f"probe answers exact: {result['probes_exact']}")
    st, (n_warm, n_after) = result["stalls"], (result["template_children_warm"], result["template_children_after"])
    print(f"longest stall: {st['longest_s'] * 1000:.0f} ms ({st['longest_raw_s'] * 1000:.0f} ms with waits for a "
          f"CPU) over {st['polls']} polls of /api/version "
          f"({st['over']} over {st['bound_s'] * 1000:.0f} ms, {st['failed']} failed); template children "
          f"{n_warm[1]} ({n_warm[0] / 2**20:.0f} MiB) -> {n_after[1]} ({n_after[0] / 2**20:.0f} MiB); "
          f"{'PASSED' if result['passed'] else 'FAILED'}")
    for at_s, took_s in st["slow_polls"]:  # what was under way then
        during = [a for a in c["attacks"] if a[0] <= at_s + took_s and at_s <= a[0] + a[2]]
        print(f"  a poll at {at_s:.1f}s took {took_s * 1000:.0f} ms; attacks under way: {during or 'none'}")
    for attack in c["attacks"]:
        if attack[3] != "left" and not (isinstance(attack[3], int) and 400 <= attack[3] < 500):
            print(f"  not refused: {attack}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
