// Small line charts on a canvas: the last five minutes of the node's samples (api/status_history.py).
"use strict";

const CHART_WINDOW_S = 300;
const CHART_COLOURS = ["#3a6ea5", "#c62828", "#2e7d32", "#d08c2a"];

function niceMax(value) {
  if (!(value > 0)) return 1;
  const step = Math.pow(10, Math.floor(Math.log10(value)));
  for (const m of [1, 2, 2.5, 5, 10]) if (value <= m * step) return m * step;
  return 10 * step;
}

function formatTick(value) {
  if (value === 0) return "0";
  if (Math.abs(value) >= 1000) return (value / 1000).toFixed(1).replace(/\.0$/, "") + "k";
  if (Math.abs(value) < 0.1) return value.toFixed(3);
  return String(Number(value.toFixed(2)));
}

// series: [{label, points: [[t, value or null], ...]}]; nowS: the right edge (epoch s).
function drawChart(canvas, series, nowS, fixedMax) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const style = getComputedStyle(document.body);
  const muted = style.getPropertyValue("--muted").trim() || "#888";
  const line = style.getPropertyValue("--line").trim() || "#ccc";
  const left = 40, right = 14, top = 6, bottom = 16;
  let top_value = 0;
  for (const s of series) for (const [, v] of s.points) if (v !== null && v > top_value) top_value = v;
  const maxValue = fixedMax || niceMax(top_value);
  const x = (t) => left + (width - left - right) * (1 - (nowS - t) / CHART_WINDOW_S);
  const y = (v) => top + (height - top - bottom) * (1 - v / maxValue);
  ctx.font = "10px system-ui, sans-serif";
  ctx.fillStyle = muted;
  ctx.strokeStyle = line;
  ctx.lineWidth = 1;
  for (const frac of [0, 0.5, 1]) {
    const v = maxValue * frac, py = Math.round(y(v)) + 0.5;
    ctx.beginPath(); ctx.moveTo(left, py); ctx.lineTo(width - right, py); ctx.stroke();
    ctx.textAlign = "right"; ctx.textBaseline = "middle";
    ctx.fillText(formatTick(v), left - 4, py);
  }
  ctx.textBaseline = "top";
  for (const ago of [300, 240, 180, 120, 60, 0]) {
    ctx.textAlign = ago ? "center" : "right";
    ctx.fillText(ago ? `-${ago / 60}m` : "now", ago ? x(nowS - ago) : width, height - bottom + 3);
  }
  series.forEach((s, i) => {
    ctx.strokeStyle = CHART_COLOURS[i % CHART_COLOURS.length];
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    const points = s.points.filter(([t]) => nowS - t <= CHART_WINDOW_S);
    points.forEach(([t, v], j) => {
      if (v === null) return;
      const joined = j > 0 && points[j - 1][1] !== null;
      if (joined) ctx.lineTo(x(t), y(v)); else ctx.moveTo(x(t), y(v));
      const alone = !joined && (j + 1 >= points.length || points[j + 1][1] === null);
      if (alone) ctx.rect(x(t) - 1, y(v) - 1, 2, 2);  // a lone sample still shows
    });
    ctx.stroke();
  });
  if (series.length > 1) {
    ctx.textAlign = "left"; ctx.textBaseline = "top";
    let px = left + 6;
    series.forEach((s, i) => {
      ctx.fillStyle = CHART_COLOURS[i % CHART_COLOURS.length];
      ctx.fillText(s.label, px, top + 2);
      px += ctx.measureText(s.label).width + 12;
    });
  }
}

// samples: the page's history, oldest first.
function drawCharts(samples, nowS) {
  const pick = (key, scale) => samples.map((s) => [s.t, s[key] === null ? null : s[key] * (scale || 1)]);
  drawChart(document.getElementById("chart-tokens"), [{label: "tokens/s", points: pick("tokens_per_s")}], nowS);
  drawChart(document.getElementById("chart-ttft"), [{label: "p50", points: pick("ttft_p50_s")},
                                                    {label: "p99", points: pick("ttft_p99_s")}], nowS);
  drawChart(document.getElementById("chart-queue"), [{label: "queued", points: pick("queued")},
                                                     {label: "running", points: pick("running")}], nowS);
  drawChart(document.getElementById("chart-kv"), [{label: "KV %", points: pick("kv_used_fraction", 100)}], nowS, 100);
}
