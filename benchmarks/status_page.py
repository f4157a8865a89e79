"""What the status page costs the engine: serving tok/s at concurrency --concurrency with /ui open in a
headless Chromium (polling /api/status once a second, as a person's tab does) against without it.

Rounds alternate off, on, on, off, ... (ABBA, so a drift of the machine during the run cancels out),
each a closed-loop benchmarks/serve.py run of --num-prompts requests. The page's browser is Debian's
chromium through chromium-driver, launched as the tests launch it (tests/browser_fixture.py), with an
admin key when given one (the page then also draws the devices and the charts).

    .venv/bin/gpushare serve &                      # the daemon under test, on a quiet machine
    .venv/bin/python benchmarks/status_page.py --base-url http://127.0.0.1:11434 --model smollm2:135m \\
        --concurrency 16 --num-prompts 128 --rounds 8 --json-out status_page.json

Prints each round's output tok/s and the ratio of the means (on / off); the issue's bar is within 2%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from browser_fixture import chromium  # noqa: E402
from serve import run_benchmark  # noqa: E402


def open_page(driver, base_url: str, key: str | None) -> None:
    driver.get(base_url.rstrip("/") + "/ui")
    if key:
        driver.execute_script("sessionStorage.setItem('gpushare.apiKey', arguments[0]); location.reload()", key)


def one_round(args) -> float:
    result = asyncio.run(run_benchmark(args.base_url, args.model, num_prompts=args.num_prompts,
                                       input_len=args.input_len, output_len=args.output_len,
                                       concurrency=args.concurrency, warmup=False, progress=False))
    if result["errors"]:
        raise SystemExit(f"requests failed: {result['errors']}")
    return result["metrics"]["output_throughput_tok_s"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, nargs=2, default=(32, 128), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(64, 128), metavar=("MIN", "MAX"))
    p.add_argument("--rounds", type=int, default=8, help="rounds in all, half with the page open (even)")
    p.add_argument("--admin-key", default=os.environ.get("GPUSHARE_API_KEY"))
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    one_round(args)  # warm-up: model loaded, kernels built, caches hot
    rates = {"off": [], "on": []}
    with chromium() as driver:
        for i in range(args.rounds):
            page_open = i % 4 in (1, 2)
            if page_open:
                open_page(driver, args.base_url, args.admin_key)
            else:
                driver.get("about:blank")
            rate = one_round(args)
            rates["on" if page_open else "off"].append(rate)
            print(f"round {i + 1}: page {'open' if page_open else 'closed'}: {rate:.1f} tok/s", flush=True)
    off, on = statistics.mean(rates["off"]), statistics.mean(rates["on"])
    print(f"page closed {off:.1f} tok/s, open {on:.1f} tok/s: {on / off:.4f}x")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"config": vars(args) | {"admin_key": bool(args.admin_key)}, "tok_per_s": rates,
                       "ratio_on_off": on / off}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
