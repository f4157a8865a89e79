"""The CPU's prefill attention alone: ms per layer for one prompt chunk over a long cached prefix.

    .venv/bin/python benchmarks/prefill_attention.py                    # chunks of 2,048 ending at 2k-8k
    .venv/bin/python benchmarks/prefill_attention.py --ends 8192 --chunk 512 --kv-dtype float32

A chunk of ``--chunk`` prompt rows whose last row sits at each ``--ends`` position attends to its
sequence's cached keys (SmolLM2's shape by default: 9 query and 3 KV heads of 64, blocks of 16) in
one C++ call (kernels.attention_by_row, as a step's prompt chunk does). Prints the best of
``--reps`` calls and GFLOP/s, counting a score's and a value's multiply and add as two each:
4 x head_dim per query head and key. Run it with nothing else on the machine.
"""

import argparse
import time

import torch

from gpushare import kernels
from gpushare.kernels import cpu_ops


def chunk_ms(end: int, chunk: int, q_heads: int, kv_heads: int, head_dim: int, block_size: int,
             kv_dtype: torch.dtype, reps: int) -> tuple[float, float]:
    """Best ms of `reps` calls and the GFLOP/s it makes, for rows [end - chunk, end)."""
    blocks = -(-end // block_size)
    k = torch.randn(blocks, block_size, kv_heads, head_dim).to(kv_dtype)
    v = torch.randn(blocks, block_size, kv_heads, head_dim).to(kv_dtype)
    tables = torch.arange(blocks, dtype=torch.int32).expand(chunk, blocks).contiguous()
    lengths = torch.arange(end - chunk + 1, end + 1, dtype=torch.int32)
    q = torch.randn(chunk, q_heads, head_dim)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        kernels.attention_by_row(q, k, v, tables, lengths, head_dim ** -0.5)
        best = min(best, time.perf_counter() - start)
    flops = float(lengths.sum()) * q_heads * head_dim * 4
    return best * 1e3, flops / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ends", default="2048,4096,6144,8192", help="positions the chunk ends at, comma-separated")
    p.add_argument("--chunk", type=int, default=2048, help="prompt rows a call (engine.max_num_batched_tokens)")
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    if not cpu_ops.loaded():
        raise SystemExit("the C++ kernels did not build here (see the log): nothing to time")
    torch.set_num_threads(args.threads)
    print(f"kernels: {cpu_ops.isa()}, {args.kv_dtype} KV, {args.threads} threads, {args.q_heads}/{args.kv_heads} "
          f"heads of {args.head_dim}, chunks of {args.chunk} rows")
    for end in (int(x) for x in args.ends.split(",")):
        ms, gflops = chunk_ms(end, min(args.chunk, end), args.q_heads, args.kv_heads, args.head_dim, args.block_size,
                              getattr(torch, args.kv_dtype), args.reps)
        print(f"chunk ending at {end:>6}: {ms:8.1f} ms a layer, {gflops:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
