"""The model's linears alone, per weight format: ms per model step at batch 1, 16 and 64.

    .venv/bin/python benchmarks/linears.py                         # float32 bfloat16 int8 int4
    .venv/bin/python benchmarks/linears.py --weights int8 --threads 1

Loads the bundled SmolLM2 GGUF in each format and runs every linear of every layer (q/k/v,
o, gate/up, down) on random activations of the engine's dtype, then lm_head apart, through the
same Linear modules and kernels the engine uses. Each figure is the best of `--reps` whole
passes (the least disturbed by anything else on the machine). Run it with nothing else running.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from perplexity import find_gguf  # noqa: E402

from gpushare.models.cpu_kernels import best_time_s  # noqa: E402
from gpushare.models.linear import Linear  # noqa: E402
from gpushare.models.loader import load_model  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", nargs="+", default=["float32", "bfloat16", "int8", "int4"])
    p.add_argument("--batch", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = find_gguf()
    print(f"ms per step, best of {args.reps}, {args.threads} threads; layers' linears | lm_head")
    print(f"{'weights':10}" + "".join(f"{'batch ' + str(b):>22}" for b in args.batch))
    for weights in args.weights:
        loaded = load_model(path, weights=weights)
        model = loaded.model
        layers = [m for layer in model.layers for m in layer.modules() if isinstance(m, Linear)]
        cells = []
        with torch.inference_mode():
            for batch in args.batch:
                inputs = {m: torch.randn(batch, m.in_features) for m in layers}
                layer_ms = best_time_s(lambda: [m(inputs[m]) for m in layers], args.reps) * 1e3
                x = torch.randn(batch, model.lm_head.in_features)
                head_ms = best_time_s(lambda: model.lm_head(x), args.reps) * 1e3
                cells.append(f"{layer_ms:8.1f} | {head_ms:5.1f}")
        print(f"{weights:10}" + "".join(f"{c:>22}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
