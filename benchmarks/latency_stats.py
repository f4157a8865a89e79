"""Serving metrics from per-request timelines (pure computations, no I/O).

Definitions follow vLLM's benchmark_serving so our numbers read like theirs:

- TTFT (time to first token): first streamed chunk carrying output minus send time.
- ITL (inter-token latency): gaps between consecutive output chunks of one request;
  every gap of every request goes into one pooled list.
- TPOT (time per output token): (E2E latency - TTFT) / (output tokens - 1), per
  request, only for requests with more than one output token.
- E2EL: last chunk of the response minus send time.
- Throughput: completed requests (and their output tokens) per second of benchmark
  wall time; goodput: completed requests per second that met every SLO given
  (a request with a single output token counts its TPOT as 0, as vLLM does).
- Percentiles interpolate linearly between order statistics (numpy's default).

Times are seconds in, milliseconds out (the `_ms` fields of the summary).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestTimeline:
    """What the client saw of one request, in `time.perf_counter()` seconds."""

    start_s: float
    chunk_times_s: list[float] = field(default_factory=list)  # arrivals of chunks with output
    end_s: float = 0.0  # arrival of the last chunk of the response (usage chunk included)
    output_tokens: int = 0  # from the server's usage when it reports it
    prompt_tokens: int = 0
    success: bool = True
    error: str | None = None


def ttft_s(t: RequestTimeline) -> float:
    return t.chunk_times_s[0] - t.start_s


def e2el_s(t: RequestTimeline) -> float:
    return t.end_s - t.start_s


def tpot_s(t: RequestTimeline) -> float | None:
    """None when the request produced fewer than two tokens (TPOT is undefined)."""
    if t.output_tokens < 2:
        return None
    return (e2el_s(t) - ttft_s(t)) / (t.output_tokens - 1)


def itl_s(t: RequestTimeline) -> list[float]:
    times = t.chunk_times_s
    return [b - a for a, b in zip(times, times[1:])]


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def summarize_ms(values_s: list[float]) -> dict:
    """mean and p50/p90/p99 in milliseconds; None fields when there are no values."""
    if not values_s:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ms = [v * 1000.0 for v in values_s]
    return {"mean": float(np.mean(ms)), **{f"p{q}": percentile(ms, q) for q in PERCENTILES}}


def is_good(t: RequestTimeline, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if not t.success or not t.chunk_times_s:
        return False
    if slo_ttft_ms is not None and ttft_s(t) * 1000.0 > slo_ttft_ms:
        return False
    if slo_tpot_ms is not None and (tpot_s(t) or 0.0) * 1000.0 > slo_tpot_ms:
        return False
    return True


def compute_metrics(
    timelines: list[RequestTimeline],
    duration_s: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> dict:
    """Aggregate metrics of one benchmark run lasting `duration_s` of wall time.

    A request counts as completed when it succeeded and streamed at least one output
    chunk; the others are failures and add nothing but to `failed`.
    """
    done = [t for t in timelines if t.success and t.chunk_times_s]
    ttfts = [ttft_s(t) for t in done]
    tpots = [v for v in (tpot_s(t) for t in done) if v is not None]
    itls = [gap for t in done for gap in itl_s(t)]
    e2els = [e2el_s(t) for t in done]
    input_tokens = sum(t.prompt_tokens for t in done)
    output_tokens = sum(t.output_tokens for t in done)
    has_slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    good = sum(is_good(t, slo_ttft_ms, slo_tpot_ms) for t in done) if has_slo else None
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    return {
        "completed": len(done),
        "failed": len(timelines) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput_rps": per_s(len(done)),
        "output_throughput_tok_s": per_s(output_tokens),
        "total_token_throughput_tok_s": per_s(input_tokens + output_tokens),
        "good_requests": good,
        "goodput_rps": per_s(good) if has_slo else None,
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "ttft_ms": summarize_ms(ttfts),
        "tpot_ms": summarize_ms(tpots),
        "itl_ms": summarize_ms(itls),
        "e2el_ms": summarize_ms(e2els),
    }


def format_table(metrics: dict, title: str = "") -> str:
    """The run's metrics as a fixed-width text table (vLLM's layout)."""
    width = 52
    lines = [f" {title} ".center(width, "=")] if title else ["=" * width]

    def row(name, value, fmt="{:.2f}"):
        shown = "n/a" if value is None else fmt.format(value)
        lines.append(f"{name:<38}{shown:>14}")

    row("Successful requests:", metrics["completed"], "{}")
    row("Failed requests:", metrics["failed"], "{}")
    row("Benchmark duration (s):", metrics["duration_s"])
    row("Total input tokens:", metrics["total_input_tokens"], "{}")
    row("Total generated tokens:", metrics["total_output_tokens"], "{}")
    row("Request throughput (req/s):", metrics["request_throughput_rps"])
    row("Output token throughput (tok/s):", metrics["output_throughput_tok_s"])
    row("Total token throughput (tok/s):", metrics["total_token_throughput_tok_s"])
    if metrics["goodput_rps"] is not None:
        row("Request goodput (req/s):", metrics["goodput_rps"])
    for key, label in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        lines.append(f" {label} ".center(width, "-"))
        stats = metrics[key]
        row(f"Mean {key.split('_')[0].upper()} (ms):", stats["mean"])
        for q in PERCENTILES:
            row(f"P{q} {key.split('_')[0].upper()} (ms):", stats[f"p{q}"])
    lines.append("=" * width)
    return "\n".join(lines)
