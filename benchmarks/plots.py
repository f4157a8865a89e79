"""Figures and tables from a run_all results JSON (matplotlib, Agg backend: no display needed).

- throughput_vs_concurrency.png: output tokens/s against concurrency, one line per system
- latency_vs_rate.png: TTFT and ITL p50 (solid) and p99 (dashed) against request rate
- kv_blocks.png: our daemon's KV blocks in use over the run, sampled from GET /api/ps
- tables of the same numbers and of gpushare's ratios against each baseline, as text for
  the terminal and as Markdown for docs/benchmarks.md (`publish` rewrites its results section)

    python benchmarks/plots.py benchmarks/results/RUN.json --out-dir /tmp/plots
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402


def _by_system(points: list[dict], x_key: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for pt in points:
        if pt.get("metrics"):
            out.setdefault(pt["system"], []).append(pt)
    for pts in out.values():
        pts.sort(key=lambda p: p[x_key])
    return out


def plot_throughput_vs_concurrency(concurrency_sweep: list[dict], path: str) -> str | None:
    """Output tokens/s per concurrency level (batch size for static-batching systems)."""
    series = _by_system(concurrency_sweep, "concurrency")
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system, pts in series.items():
        xs = [p["concurrency"] for p in pts]
        ys = [p["metrics"]["output_throughput_tok_s"] for p in pts]
        ax.plot(xs, ys, marker="o", label=system)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({p["concurrency"] for pts in series.values() for p in pts}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("concurrent requests (batch size for transformers)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Output throughput vs concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_latency_vs_rate(rate_sweep: list[dict], path: str) -> str | None:
    """TTFT and ITL, p50 solid and p99 dashed, per Poisson request rate."""
    series = _by_system(rate_sweep, "rate")
    if not series:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key, name in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "itl_ms", "ITL")):
        for i, (system, pts) in enumerate(series.items()):
            color = f"C{i}"
            xs = [p["rate"] for p in pts]
            for q, style in (("p50", "-"), ("p99", "--")):
                ys = [p["metrics"][key][q] for p in pts]
                ys = [float("nan") if y is None else y for y in ys]
                ax.plot(xs, ys, style, marker="o", color=color, label=f"{system} {q}")
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} vs request rate")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_kv_blocks(kv_samples: list[dict], path: str) -> str | None:
    """KV blocks in use over time, with the pool size; None when the daemon reported none."""
    pts = [s for s in kv_samples if s.get("kv_blocks_used") is not None]
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(11, 4))
    ts = [s["t_s"] for s in pts]
    ax.plot(ts, [s["kv_blocks_used"] for s in pts], lw=1, label="blocks in use")
    totals = [s.get("kv_blocks_total") for s in pts]
    if any(t is not None for t in totals):
        ax.plot(ts, [float("nan") if t is None else t for t in totals], "--", lw=1, color="grey",
                label="blocks in pool")
    # Mark where each benchmark phase starts so bumps can be matched to a sweep point.
    seen = set()
    for s in pts:
        phase = s.get("phase")
        if phase and phase not in seen:
            seen.add(phase)
            ax.axvline(s["t_s"], color="black", alpha=0.15, lw=0.8)
            ax.text(s["t_s"], 0.02, f" {phase}", transform=ax.get_xaxis_transform(), rotation=90,
                    va="bottom", fontsize=7, alpha=0.7)
    ax.set_xlabel("time since start of run (s)")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("KV blocks")
    ax.set_title("gpushare KV cache blocks in use (GET /api/ps)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_all(results: dict, out_dir: str) -> list[str]:
    """Every figure the results support; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    written = [
        plot_throughput_vs_concurrency(results.get("concurrency_sweep", []),
                                       os.path.join(out_dir, "throughput_vs_concurrency.png")),
        plot_latency_vs_rate(results.get("rate_sweep", []), os.path.join(out_dir, "latency_vs_rate.png")),
        plot_kv_blocks(results.get("kv_samples", []), os.path.join(out_dir, "kv_blocks.png")),
    ]
    return [p for p in written if p]


def fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def derive_rates(concurrency_sweep: list[dict], fractions: tuple[float, ...], system: str) -> list[float]:
    """Request rates as fractions of `system`'s peak request throughput (2 significant
    digits), so the sweep goes from light load to overload on any machine."""
    peaks = [p["metrics"]["request_throughput_rps"] for p in concurrency_sweep
             if p["system"] == system and p.get("metrics")]
    peak = max(peaks, default=1.0)
    return [float(f"{f * peak:.2g}") for f in fractions]


def _metric(points: list[dict], system: str, x_key: str, x) -> dict | None:
    return next((p["metrics"] for p in points if p["system"] == system and p[x_key] == x and p.get("metrics")), None)


def ratios(results: dict, ours: str) -> dict:
    """gpushare against each baseline, >1 meaning gpushare is better: output tok/s
    ours/theirs per concurrency; TTFT and ITL p50 theirs/ours per request rate."""
    conc, rate = results.get("concurrency_sweep", []), results.get("rate_sweep", [])
    out = {}
    for base in sorted({p["system"] for p in conc + rate} - {ours}):
        by_c = {}
        for c in sorted({p["concurrency"] for p in conc}):
            a, b = _metric(conc, ours, "concurrency", c), _metric(conc, base, "concurrency", c)
            if a and b and b["output_throughput_tok_s"]:
                by_c[str(c)] = a["output_throughput_tok_s"] / b["output_throughput_tok_s"]
        by_r = {}
        for r in sorted({p["rate"] for p in rate}):
            a, b = _metric(rate, ours, "rate", r), _metric(rate, base, "rate", r)
            if a and b:
                by_r[str(r)] = {k: (b[k]["p50"] / a[k]["p50"] if a[k]["p50"] and b[k]["p50"] else None)
                                for k in ("ttft_ms", "itl_ms")}
        out[base] = {"output_tok_s_by_concurrency": by_c, "latency_p50_by_rate": by_r}
    return out


def tables(results: dict, ours: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) for throughput, latency and ratio tables."""
    conc, rate = results.get("concurrency_sweep", []), results.get("rate_sweep", [])
    out = []
    systems = sorted({p["system"] for p in conc}, key=lambda s: (s != ours, s))
    if systems:
        rows = [[str(c)] + [fmt((_metric(conc, s, "concurrency", c) or {}).get("output_throughput_tok_s")) for s in systems]
                for c in sorted({p["concurrency"] for p in conc})]
        out.append(("Output tokens/s by concurrency", ["concurrency"] + systems, rows))
    systems = sorted({p["system"] for p in rate}, key=lambda s: (s != ours, s))
    if systems:
        header = ["req/s"] + [f"{s} {k} {q}" for s in systems for k in ("TTFT", "ITL") for q in ("p50", "p99")]
        rows = []
        for r in sorted({p["rate"] for p in rate}):
            row = [str(r)]
            for s in systems:
                m = _metric(rate, s, "rate", r) or {}
                row += [fmt((m.get(k) or {}).get(q)) for k in ("ttft_ms", "itl_ms") for q in ("p50", "p99")]
            rows.append(row)
        out.append(("Latency (ms) by Poisson request rate", header, rows))
    for base, rat in results.get("ratios", {}).items():
        rows = [[f"concurrency {c}", fmt(v, 2), "", ""] for c, v in rat["output_tok_s_by_concurrency"].items()]
        rows += [[f"{r} req/s", "", fmt(v["ttft_ms"], 2), fmt(v["itl_ms"], 2)]
                 for r, v in rat["latency_p50_by_rate"].items()]
        if rows:
            out.append((f"{ours} vs {base} (x, >1: {ours} better)", ["point", "out tok/s", "TTFT p50", "ITL p50"], rows))
    return out


def text_tables(results: dict, ours: str) -> str:
    parts = []
    for title, header, rows in tables(results, ours):
        widths = [max(len(x) for x in col) for col in zip(header, *rows)]
        line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
        parts.append("\n".join([title, line(header), *map(line, rows)]))
    return "\n\n".join(parts)


def markdown_tables(results: dict, ours: str) -> str:
    parts = []
    for title, header, rows in tables(results, ours):
        md = [f"**{title}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        md += ["| " + " | ".join(r) + " |" for r in rows]
        parts.append("\n".join(md))
    return "\n\n".join(parts)


RESULTS_BEGIN, RESULTS_END = "<!-- results:begin (run_all.py rewrites this section) -->", "<!-- results:end -->"


def serving_line(serving: dict | None) -> str:
    """What gpushare served the figures with (run_all.serving_formats), in one sentence: each model's
    weight format and kernels, the C++ kernels' ISA and build, the CPU's SIMD flags; a figure
    without them cannot be compared with another machine's or build's."""
    if not serving:
        return "gpushare served with: not recorded."
    if "error" in serving:
        return f"gpushare served with: unknown ({serving['error']})."
    models = ", ".join(f"`{name}` {m.get('weights')} on `{m.get('kernel')}`" for name, m in serving.get("models", {}).items())
    kernels = serving.get("kernels") or {}
    env = " ".join(f"{k}={v}" for k, v in (serving.get("env") or {}).items())
    return (f"gpushare served with: {models or 'no model loaded'}; kernels ISA `{kernels.get('isa')}` "
            f"(block kernel `{kernels.get('block_kernel')}`, build `{kernels.get('build')}`); CPU flags "
            f"`{' '.join(serving.get('cpu_flags') or []) or 'none'}`{f'; environment {env}' if env else ''}.")


def publish(results: dict, pngs: list[str], root: str, ours: str = "gpushare") -> None:
    """Copy the figures to docs/benchmarks/ and rewrite the results section of docs/benchmarks.md."""
    fig_dir = os.path.join(root, "docs", "benchmarks")
    os.makedirs(fig_dir, exist_ok=True)
    for path in pngs:
        shutil.copy(path, fig_dir)
    doc_path = os.path.join(root, "docs", "benchmarks.md")
    with open(doc_path) as f:
        doc = f.read()
    if RESULTS_BEGIN not in doc or RESULTS_END not in doc:
        print(f"{doc_path}: results markers missing; section not updated", file=sys.stderr)
        return
    m, s = results["machine"], results["settings"]
    skipped = "; ".join(f"{n}: {v['skipped']}" for n, v in results.get("systems", {}).items() if "skipped" in v)
    body = [f"Run {results['created']} at commit `{(results['git']['commit'] or 'none')[:12]}`"
            f"{' (dirty tree)' if results['git']['dirty'] else ''}: {m['cpu_model']}, {m['physical_cores']} cores, "
            f"{m['ram_bytes'] / 2**30:.0f} GiB RAM, {s['threads']} threads, model `{s['model']}`.",
            "", serving_line(s.get("serving")),
            *([f"Skipped: {skipped}."] if skipped else []), "", markdown_tables(results, ours), ""]
    body += [f"![{os.path.basename(p)}](benchmarks/{os.path.basename(p)})" for p in pngs]
    start, end = doc.index(RESULTS_BEGIN) + len(RESULTS_BEGIN), doc.index(RESULTS_END)
    with open(doc_path, "w") as f:
        f.write(doc[:start] + "\n" + "\n".join(body) + "\n" + doc[end:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Plot a run_all results JSON")
    p.add_argument("results_json")
    p.add_argument("--out-dir", default=".")
    args = p.parse_args(argv)
    with open(args.results_json) as f:
        results = json.load(f)
    for path in plot_all(results, args.out_dir):
        print(path)
    print(text_tables(results, "gpushare"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
