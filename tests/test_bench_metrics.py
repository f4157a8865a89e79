"""Benchmark tooling: metric definitions on hand-computed timelines, workload and arrival
generation, the figures and tables, and serve.py's error on an unreachable server."""

import asyncio
import os
import socket
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import plots  # noqa: E402
import run_all  # noqa: E402
import serve  # noqa: E402
import systems  # noqa: E402
from latency_stats import (RequestTimeline, compute_metrics, format_table, itl_s, percentile,  # noqa: E402
                           tpot_s, ttft_s)


def three_requests_and_a_failure():
    # A: TTFT 0.5, ITL 0.1 0.2 0.3, E2EL 1.1, TPOT (1.1-0.5)/3 = 0.2
    a = RequestTimeline(start_s=0.0, chunk_times_s=[0.5, 0.6, 0.8, 1.1], end_s=1.1, output_tokens=4, prompt_tokens=10)
    # B: usage chunk 0.1 s after the last token: E2EL 0.7, TTFT 0.2, TPOT (0.7-0.2)/1 = 0.5, ITL 0.4
    b = RequestTimeline(start_s=1.0, chunk_times_s=[1.2, 1.6], end_s=1.7, output_tokens=2, prompt_tokens=6)
    # C: one token: TTFT 1.0, no TPOT, no ITL
    c = RequestTimeline(start_s=2.0, chunk_times_s=[3.0], end_s=3.0, output_tokens=1, prompt_tokens=4)
    d = RequestTimeline(start_s=2.5, end_s=2.6, success=False, error="HTTP 500: boom", prompt_tokens=99)
    return [a, b, c, d]


def test_per_request_definitions():
    a, b, c, _ = three_requests_and_a_failure()
    assert ttft_s(a) == pytest.approx(0.5)
    assert tpot_s(a) == pytest.approx(0.2)
    assert itl_s(a) == pytest.approx([0.1, 0.2, 0.3])
    assert tpot_s(b) == pytest.approx(0.5)
    assert tpot_s(c) is None and itl_s(c) == []


def test_percentiles_interpolate_linearly():
    assert percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([5.0], 99) == 5.0


def test_aggregate_metrics_match_hand_computation():
    m = compute_metrics(three_requests_and_a_failure(), duration_s=4.0)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (20, 7)
    assert m["request_throughput_rps"] == pytest.approx(0.75)
    assert m["output_throughput_tok_s"] == pytest.approx(1.75)
    assert m["total_token_throughput_tok_s"] == pytest.approx(6.75)
    # TTFT ms [500, 200, 1000]: sorted 200 500 1000; p90 at rank 1.8 -> 500 + 0.8 * 500
    assert m["ttft_ms"] == pytest.approx({"mean": 1700 / 3, "p50": 500, "p90": 900, "p99": 990})
    # TPOT ms [200, 500] (C has one token and no TPOT)
    assert m["tpot_ms"] == pytest.approx({"mean": 350, "p50": 350, "p90": 470, "p99": 497})
    # ITL ms pooled over requests: [100, 200, 300, 400]
    assert m["itl_ms"] == pytest.approx({"mean": 250, "p50": 250, "p90": 370, "p99": 397})
    assert m["e2el_ms"]["mean"] == pytest.approx(2800 / 3)
    assert m["goodput_rps"] is None and m["good_requests"] is None


def test_goodput_counts_requests_meeting_every_slo():
    timelines = three_requests_and_a_failure()
    both = compute_metrics(timelines, 4.0, slo_ttft_ms=600, slo_tpot_ms=300)
    assert both["good_requests"] == 1  # A; B misses TPOT, C misses TTFT, D failed
    assert both["goodput_rps"] == pytest.approx(0.25)
    # a one-token request has TPOT 0 for goodput (vLLM's rule): A and C meet 300 ms
    assert compute_metrics(timelines, 4.0, slo_tpot_ms=300)["good_requests"] == 2
    assert compute_metrics(timelines, 4.0, slo_ttft_ms=150)["good_requests"] == 0


def test_no_completed_requests_gives_empty_stats_not_a_crash():
    m = compute_metrics([RequestTimeline(start_s=0.0, success=False, error="x")], 1.0)
    assert (m["completed"], m["failed"], m["ttft_ms"]["p99"]) == (0, 1, None)
    assert "n/a" in format_table(m)


def test_format_table_shows_the_numbers():
    text = format_table(compute_metrics(three_requests_and_a_failure(), 4.0, slo_ttft_ms=600), "t")
    assert "Successful requests:" in text and "990.00" in text and "Request goodput (req/s):" in text


def test_workload_is_seeded_in_range_and_prefix_stable():
    w = serve.make_workload(50, (5, 9), (3, 7), seed=3)
    assert w == serve.make_workload(50, (5, 9), (3, 7), seed=3)
    assert w != serve.make_workload(50, (5, 9), (3, 7), seed=4)
    assert w[:10] == serve.make_workload(10, (5, 9), (3, 7), seed=3)  # same prompts at every sweep size
    prefix = len("Continue this text:".split())
    assert all(5 <= len(p.split()) - prefix <= 9 and 3 <= n <= 7 for p, n in w)
    assert {n for _, n in w} == {3, 4, 5, 6, 7}


def test_parse_range():
    assert serve.parse_range("64") == (64, 64)
    assert serve.parse_range("32:128") == (32, 128)
    with pytest.raises(ValueError):
        serve.parse_range("9:3")


def test_arrivals_poisson_and_bursty():
    assert serve.arrival_offsets_s(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    for burstiness, cv in ((1.0, 1.0), (0.25, 2.0), (4.0, 0.5)):
        offsets = serve.arrival_offsets_s(20000, 5.0, burstiness, seed=0)
        gaps = np.diff(offsets)
        assert offsets[0] == 0.0 and (gaps >= 0).all()
        assert gaps.mean() == pytest.approx(0.2, rel=0.05)  # 1 / rate
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)  # 1 / sqrt(shape)


def test_unreachable_server_is_a_clear_error(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(serve.BenchmarkError, match="failed"):
        asyncio.run(serve.run_benchmark(url, "m", num_prompts=2, progress=False))
    assert serve.main(["--base-url", url, "--model", "m", "--num-prompts", "2"]) == 1
    assert "error:" in capsys.readouterr().err


def test_server_process_waits_for_readiness_and_reports_early_exit(tmp_path):
    port = systems.free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    server = systems.ServerProcess("web", argv, f"http://127.0.0.1:{port}/", str(tmp_path / "web.log"), dict(os.environ))
    server.start(timeout_s=30)
    try:
        assert server.alive()
    finally:
        server.stop()
    assert not server.alive()
    crash = [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"]
    dead = systems.ServerProcess("bad", crash, "http://127.0.0.1:1/", str(tmp_path / "bad.log"), dict(os.environ))
    with pytest.raises(RuntimeError, match="exited with 3: no model here"):
        dead.start(timeout_s=30)


def test_quick_rate_points_are_capped_by_the_time_window():
    assert run_all.prompts_for_rate(run_all.QUICK, 0.19) == 4  # 20 s at 0.19/s, at least 4
    assert run_all.prompts_for_rate(run_all.QUICK, 5.0) == run_all.QUICK.rate_prompts
    assert run_all.prompts_for_rate(run_all.FULL, 0.19) == run_all.FULL.rate_prompts
    assert run_all.prompts_for(run_all.FULL, 32) == 128 and run_all.prompts_for(run_all.FULL, 1) == 16


def synthetic_results():
    def pt(system, tok_s, ttft_p50, itl_p50, **x):
        stats = lambda p50: {"mean": p50, "p50": p50, "p90": p50 * 1.5, "p99": p50 * 2}  # noqa: E731
        return {"system": system, **x, "metrics": {"output_throughput_tok_s": tok_s, "request_throughput_rps": tok_s / 50,
                                                   "ttft_ms": stats(ttft_p50), "itl_ms": stats(itl_p50)}}
    conc = [pt("gpushare", 100.0 * c, 50, 20, concurrency=c) for c in (1, 2, 4)]
    conc += [pt("llama.cpp", 50.0 * c, 80, 10, concurrency=c) for c in (1, 2, 4)]
    conc += [pt("transformers", 40.0, 0, 0, concurrency=1), {"system": "llama.cpp", "concurrency": 8,
                                                            "metrics": None, "error": "server exited"}]
    rate = [pt(s, 1, t, i, rate=r) for r in (1.0, 2.0) for s, t, i in (("gpushare", 50, 20), ("llama.cpp", 100, 10))]
    kv = [{"t_s": t * 0.25, "phase": "c=1" if t < 10 else "c=2", "kv_blocks_used": t % 7, "kv_blocks_total": 64}
          for t in range(20)]
    return {"concurrency_sweep": conc, "rate_sweep": rate, "kv_samples": kv}


def test_ratios_and_rates_against_each_baseline():
    r = synthetic_results()
    rat = plots.ratios(r, "gpushare")
    assert rat["llama.cpp"]["output_tok_s_by_concurrency"] == pytest.approx({"1": 2.0, "2": 2.0, "4": 2.0})
    assert rat["llama.cpp"]["latency_p50_by_rate"]["1.0"] == pytest.approx({"ttft_ms": 2.0, "itl_ms": 0.5})
    assert rat["transformers"]["output_tok_s_by_concurrency"] == pytest.approx({"1": 2.5})
    # gpushare peaks at 400 tok/s = 8 req/s
    assert plots.derive_rates(r["concurrency_sweep"], (0.25, 0.5, 1.0), "gpushare") == [2.0, 4.0, 8.0]
    r["ratios"] = rat
    text = plots.text_tables(r, "gpushare")
    assert "gpushare vs llama.cpp" in text and "2.50" in text and "n/a" in text  # transformers at c=2


def test_plots_write_png_files(tmp_path):
    written = plots.plot_all(synthetic_results(), str(tmp_path))
    assert sorted(os.path.basename(p) for p in written) == [
        "kv_blocks.png", "latency_vs_rate.png", "throughput_vs_concurrency.png"]
    for path in written:
        with open(path, "rb") as f:
            head = f.read(8)
        assert head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 5000


def test_kv_plot_skipped_when_daemon_reports_no_kv_fields(tmp_path):
    samples = [{"t_s": 0.1, "phase": "c=1", "kv_blocks_used": None, "kv_blocks_total": None}]
    assert plots.plot_kv_blocks(samples, str(tmp_path / "kv.png")) is None
    assert not (tmp_path / "kv.png").exists()


def test_publish_rewrites_only_the_results_section(tmp_path):
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "benchmarks.md"
    doc.write_text(f"# intro\n{plots.RESULTS_BEGIN}\nold table\n{plots.RESULTS_END}\n## after\n")
    r = synthetic_results()
    r.update(ratios=plots.ratios(r, "gpushare"), created="2026-01-01T00:00:00", git={"commit": None, "dirty": True},
             machine={"cpu_model": "CPU X", "physical_cores": 2, "ram_bytes": 8 << 30},
             settings={"threads": 2, "model": "smollm2:135m", "serving": {
                 "models": {"smollm2:135m": {"weights": "int4", "kernel": "cpu-blocks-avx2"}},
                 "cpu_flags": ["avx", "avx2", "fma"], "kernels": {"isa": "avx2", "block_kernel": "avx2", "build": "avx2-abc"},
                 "env": {"GPUSHARE_CPU_ISA": "avx2"}}},
             systems={"peer": {"skipped": "no peer"}})
    png = plots.plot_throughput_vs_concurrency(r["concurrency_sweep"], str(tmp_path / "throughput_vs_concurrency.png"))
    plots.publish(r, [png], str(tmp_path))
    text = doc.read_text()
    assert "old table" not in text and text.startswith("# intro") and text.endswith("## after\n")
    assert "| concurrency | gpushare | llama.cpp | transformers |" in text and "CPU X" in text
    assert "![throughput_vs_concurrency.png](benchmarks/throughput_vs_concurrency.png)" in text
    assert "peer: no peer" in text
    assert ("gpushare served with: `smollm2:135m` int4 on `cpu-blocks-avx2`; kernels ISA `avx2` (block kernel `avx2`, "
            "build `avx2-abc`); CPU flags `avx avx2 fma`; environment GPUSHARE_CPU_ISA=avx2.") in text
    assert (tmp_path / "docs" / "benchmarks" / "throughput_vs_concurrency.png").stat().st_size > 0
