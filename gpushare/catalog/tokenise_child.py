"""A child process that tokenises a large request's inputs for the daemon's supervisor (api/idle_work.py),
at Linux's SCHED_IDLE policy, so that it runs only on cores the engine workers leave idle.

Its own process, not a thread of the supervisor's: a SCHED_IDLE thread preempted while it holds
Python's lock (building the library's results into lists) holds the supervisor's event loop, which
relays every stream's tokens, until the scheduler gives it a core again; beside a flood of 4,000
inputs the loop stalled 40-60 times in 2.5 s, up to 38 ms (docs/benchmarks.md). A process has a lock
of its own. Torch-free: the tokenizers library and gpushare's tokenizer only.

Messages both ways are pickles, each after its length (8 bytes, little-endian); the supervisor is the
only peer. In: ``("tokenizer", key, pickled Tokenizer)`` (kept, the last MAX_TOKENIZERS) or
``("job", key, op, items, max_tokens, piece)``. Out, for a job: ``("missing",)`` when the key's
tokenizer is not here, else ``("piece", results)`` per ``piece`` items and ``("done",)``, or
``("error", text)`` at the first piece that fails.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
from collections import OrderedDict

from gpushare.catalog.llm_rerank import rerank_prompts

MAX_TOKENIZERS = 4  # the models a node embeds with at once; another one's comes again when asked
HEADER_BYTES = 8


def tokenised(tokenizer, op: str, items: list, max_tokens: int) -> list:
    """``items`` as a model reads them, cut to ``max_tokens``. ``op``: "inputs" (texts to embed:
    (ids, length uncut) each), "pairs" (a cross-encoder's (query, document) pairs: (ids, token types))
    or "prompts" (an LLM reranker's pairs: (ids, None))."""
    if op == "inputs":
        return tokenizer.encode_inputs(items, max_tokens)
    if op == "pairs":
        return [(ids, types) for ids, types, _ in tokenizer.encode_pairs(items, max_tokens)]
    if op == "prompts":
        return [(ids, None) for ids in rerank_prompts(tokenizer, items, max_tokens)]
    raise ValueError(f"no tokenising op {op!r}")


def framed(message) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return len(body).to_bytes(HEADER_BYTES, "little") + body


def _read_exactly(stream, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _read_message(stream):
    header = _read_exactly(stream, HEADER_BYTES)
    if header is None:
        return None
    body = _read_exactly(stream, int.from_bytes(header, "little"))
    return None if body is None else pickle.loads(body)


def serve(inp, out) -> None:
    tokenizers: OrderedDict = OrderedDict()
    while (message := _read_message(inp)) is not None:
        if message[0] == "tokenizer":
            _, key, blob = message
            tokenizers[key] = pickle.loads(blob)
            while len(tokenizers) > MAX_TOKENIZERS:
                tokenizers.popitem(last=False)
            continue
        _, key, op, items, max_tokens, piece = message
        tokenizer = tokenizers.get(key)
        if tokenizer is None:
            out.write(framed(("missing",)))
            out.flush()
            continue
        tokenizers.move_to_end(key)
        try:
            for start in range(0, len(items), piece):
                out.write(framed(("piece", tokenised(tokenizer, op, items[start:start + piece], max_tokens))))
                out.flush()
            out.write(framed(("done",)))
        except Exception as e:  # noqa: BLE001 - the supervisor redoes the rest itself, where it raises again
            out.write(framed(("error", f"{type(e).__name__}: {e}")))
        out.flush()


def main() -> None:
    try:  # before the library starts its threads: they take this policy from the thread that makes them
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or refused: the supervisor's patience still bounds a wait
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C on the daemon's terminal: the daemon decides
    serve(sys.stdin.buffer, sys.stdout.buffer)


if __name__ == "__main__":
    main()
