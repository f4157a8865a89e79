"""What preparing a plain chat costs in the daemon's supervisor, step by step, and how fast the work pool
prepares a burst of them (api/work.py: WORK_THREADS threads).

    .venv/bin/python benchmarks/prep_cost.py                 # the bundled SmolLM2, 512 chats
    .venv/bin/python benchmarks/prep_cost.py --requests 2000 --gguf PATH

The steps are the daemon's own functions, run as /v1/chat/completions runs them: the body parsed
(api/fields.parse_json_object), its messages read (api/openai.parse_messages), the chat template
rendered in a template child (api/template_runner.render, the path every chat takes) and, for
comparison, in this process (catalog/chat_template.render), and the text tokenised. Each is timed
over ``--requests`` distinct chats (median and p99, microseconds); then the whole preparation of
a burst of them through a pool of WORK_THREADS threads (requests/s), which is the rate the engine
can be handed new requests at. With ``--url`` of a running daemon, also the same burst sent at once as
Anthropic token counts (/v1/messages/count_tokens: HTTP, the work queue and the whole preparation,
no engine): the daemon's own rate. Run it with nothing else on the machine.
"""

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from perplexity import find_gguf  # noqa: E402

from gpushare.api import template_runner  # noqa: E402
from gpushare.api.fields import parse_json_object  # noqa: E402
from gpushare.api.openai import parse_messages  # noqa: E402
from gpushare.api.work import WORK_THREADS, WorkBudget  # noqa: E402
from gpushare.catalog import chat_template  # noqa: E402
from gpushare.catalog.model_head import load_model_head  # noqa: E402
from gpushare.settings.limit_settings import LimitSettings  # noqa: E402


def bodies(n: int) -> list[list[bytes]]:
    """n plain chats as a client sends them: a system prompt and a question, a few sampling fields."""
    return [[json.dumps({"model": "smollm2:135m", "stream": True, "max_tokens": 64, "temperature": 0.7,
                         "messages": [{"role": "system", "content": "You are a helpful assistant."},
                                      {"role": "user", "content": f"Question {i}: what is {i} times {i + 7}?"}]}
                        ).encode()] for i in range(n)]


def timed_us(fn, items) -> tuple[list, list[float]]:
    out, times = [], []
    for item in items:
        started = time.perf_counter()
        out.append(fn(item))
        times.append((time.perf_counter() - started) * 1e6)
    return out, times


def summary(name: str, times: list[float]) -> str:
    ordered = sorted(times)
    return (f"{name:<34} median {statistics.median(ordered):8.1f} us   "
            f"p99 {ordered[int(0.99 * (len(ordered) - 1))]:8.1f} us")


def prepare(model, source, limits, chunks) -> list[int]:
    """One chat's whole preparation, as the daemon's pool runs it (one job after another)."""
    body = parse_json_object(chunks, limits)
    messages = parse_messages(body, limits)
    budget = WorkBudget.starting_now(limits.work_timeout_s, 2 * limits.max_prompt_chars)
    text = template_runner.render(budget, source, messages, model.tokenizer.bos_token, model.tokenizer.eos_token)
    return model.tokenizer.encode(text, add_special_tokens=False)


async def counted_at_once(url: str, model: str, n: int) -> tuple[float, int]:
    """(seconds, answers that were 200) for ``n`` token counts sent at once."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(i: int) -> int:
            body = {"model": model, "messages": [{"role": "user", "content": f"Question {i}: what is {i} times 7?"}]}
            async with session.post(url + "/v1/messages/count_tokens", json=body) as resp:
                await resp.read()
                return resp.status
        await one(-1)
        started = time.perf_counter()
        statuses = await asyncio.gather(*(one(i) for i in range(n)))
        return time.perf_counter() - started, statuses.count(200)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", default=None, help="a GGUF; default: the bundled SmolLM2-135M")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--url", default=None, help="also a burst of token counts to this running daemon")
    parser.add_argument("--model", default="smollm2:135m", help="the model --url serves")
    args = parser.parse_args()
    model = load_model_head(args.gguf or find_gguf(), "auto")
    source, limits = model.template_source, LimitSettings()
    tok = model.tokenizer
    raw = bodies(args.requests)

    parsed, t_parse = timed_us(lambda c: parse_json_object(c, limits), raw)
    messages, t_messages = timed_us(lambda b: parse_messages(b, limits), parsed)
    budget = lambda: WorkBudget.starting_now(limits.work_timeout_s, 2 * limits.max_prompt_chars)  # noqa: E731
    template_runner.render(budget(), source, messages[0], tok.bos_token, tok.eos_token)  # the child started
    texts, t_child = timed_us(lambda m: template_runner.render(budget(), source, m, tok.bos_token, tok.eos_token),
                              messages)
    compiled = chat_template.compile_template(source)
    _, t_inproc = timed_us(lambda m: chat_template.render(compiled, m, tok.bos_token, tok.eos_token), messages)
    ids, t_tokens = timed_us(lambda t: tok.encode(t, add_special_tokens=False), texts)
    print(f"{args.requests} plain chats, {statistics.mean(map(len, ids)):.0f} prompt tokens each on average")
    for name, times in (("parse the body", t_parse), ("read the messages", t_messages),
                        ("template, in a child (served)", t_child), ("template, in this process", t_inproc),
                        ("tokenise", t_tokens)):
        print(summary(name, times))
    for threads in (1, WORK_THREADS):
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda c: prepare(model, source, limits, c), raw[:threads * 4]))  # children started
            started = time.perf_counter()
            list(pool.map(lambda c: prepare(model, source, limits, c), raw))
            took = time.perf_counter() - started
        print(f"whole preparation, {threads} thread(s): {args.requests / took:8.0f} requests/s "
              f"({took * 1e3:.0f} ms for {args.requests})")
    if args.url:
        took, ok = asyncio.run(counted_at_once(args.url.rstrip("/"), args.model, args.requests))
        print(f"daemon, {args.requests} token counts at once: {args.requests / took:8.0f} requests/s "
              f"({took * 1e3:.0f} ms, {ok} answered 200)")


if __name__ == "__main__":
    main()
