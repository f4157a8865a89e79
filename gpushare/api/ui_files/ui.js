// The status page: polls /api/status once a second and draws what it says (api/status.py).
// Every text from the daemon goes in through textContent, never as HTML. The API key lives in
// this tab's sessionStorage and goes out as a Bearer header only.
"use strict";

const POLL_INTERVAL_MS = 1000;
const KEY_STORAGE = "gpushare.apiKey";
const PAGE_ROWS = 50;  // api/status.py's PAGE_ROWS
const CATALOG_ROWS = 50;

const view = {
  models: {filter: "", offset: 0}, tenants: {filter: "", offset: 0},
  history: [], lastSampleS: 0, catalog: null, timer: null, status: null,
};

const $ = (id) => document.getElementById(id);

function apiKey() { return sessionStorage.getItem(KEY_STORAGE) || ""; }

function authHeaders(extra) {
  const key = apiKey();
  return Object.assign(key ? {Authorization: "Bearer " + key} : {}, extra || {});
}

function fmtBytes(n) {
  if (n === null || n === undefined) return "none";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0, v = n;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return i === 0 ? `${n} B` : `${v.toFixed(1)} ${units[i]}`;
}

function fmtRate(v) { return v === null ? "" : v.toFixed(1); }  // null: not shown to this tenant

function fmtUntil(epochS, nowS) {
  const left = Math.max(0, Math.round(epochS - nowS));
  const h = Math.floor(left / 3600), m = Math.floor((left % 3600) / 60), s = left % 60;
  const two = (x) => String(x).padStart(2, "0");
  return h ? `in ${h}h ${two(m)}m` : m ? `in ${m}m ${two(s)}s` : `in ${s}s`;
}

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

function bar(parts, total, small) {
  const outer = el("div", small ? "bar small" : "bar");
  for (const [cls, bytes] of parts) {
    const seg = el("div", "seg " + cls);
    seg.style.width = (total > 0 ? Math.min(100, (100 * bytes) / total) : 0) + "%";  // CSSOM: allowed by the CSP
    outer.appendChild(seg);
  }
  return outer;
}

function showError(message) {
  $("error").hidden = !message;
  $("error").textContent = message || "";
}

// Rows keyed by name: a row that stays keeps its element (and its buttons) and gets new cell texts.
function syncRows(tbody, rows, key, cells, action) {
  const old = new Map([...tbody.children].map((tr) => [tr.dataset.key, tr]));
  for (const row of rows) {
    const k = key(row);
    let tr = old.get(k);
    const values = cells(row);
    if (!tr) {
      tr = el("tr");
      tr.dataset.key = k;
      for (const value of values) tr.appendChild(el("td"));
      if (action) tr.appendChild(el("td", "admin-only")).hidden = !(view.status && view.status.admin);
    }
    old.delete(k);
    values.forEach((value, i) => {
      const td = tr.children[i];
      if (value instanceof Node) { td.replaceChildren(value); return; }
      const [text, cls] = Array.isArray(value) ? value : [value, typeof value === "number" ? "num" : ""];
      if (td.textContent !== String(text)) td.textContent = String(text);
      td.className = cls;
    });
    if (action) action(tr.lastElementChild, row);
    tbody.appendChild(tr);  // moves an existing row into order
  }
  for (const tr of old.values()) tr.remove();
}

function renderPager(id, state, page) {
  const pager = $(id);
  pager.replaceChildren();
  if (page.matching <= PAGE_ROWS && page.offset === 0) return;
  const first = page.matching ? page.offset + 1 : 0, last = Math.min(page.offset + PAGE_ROWS, page.matching);
  const prev = el("button", "", "Previous"), next = el("button", "", "Next");
  prev.type = next.type = "button";
  prev.disabled = page.offset === 0;
  next.disabled = page.offset + PAGE_ROWS >= page.matching;
  prev.addEventListener("click", () => { state.offset = Math.max(0, state.offset - PAGE_ROWS); pollSoon(); });
  next.addEventListener("click", () => { state.offset += PAGE_ROWS; pollSoon(); });
  pager.append(prev, el("span", "muted", `${first}–${last} of ${page.matching}`), next);
}

function countText(page) {
  return page.matching === page.total ? `(${page.total})` : `(${page.matching} of ${page.total})`;
}

function renderDevices(devices) {
  const box = $("devices");
  box.replaceChildren();
  for (const d of devices) {
    const card = el("div", "device");
    card.dataset.device = d.device;
    const head = el("div", "device-head");
    head.append(el("span", "device-name", d.device), el("span", "muted", d.kind),
                el("span", "pid", d.worker_pid === null ? "no worker" : `pid ${d.worker_pid}`),
                el("span", d.healthy ? "healthy" : "unhealthy", d.healthy ? "healthy" : "unhealthy"),
                el("span", "restarts", `${d.restarts} restarts`));
    if (d.reason) head.appendChild(el("span", "unhealthy", d.reason));
    const kvRest = Math.max(0, d.kv_pool_bytes - d.kv_committed_bytes);
    const parts = [["weights", d.weight_bytes], ["kv", d.kv_committed_bytes], ["pool", kvRest],
                   ["other", d.other_bytes], ["free", d.free_bytes]];
    const legend = el("div", "legend");
    const names = {weights: "weights", kv: "KV committed", pool: "KV pool, uncommitted", other: "loading",
                   free: "free"};
    for (const [cls, bytes] of parts) {
      if (cls === "other" && !bytes) continue;
      const item = el("span", "legend-" + cls);
      item.append(el("span", "swatch seg " + cls), `${names[cls]} ${fmtBytes(bytes)}`);
      legend.appendChild(item);
    }
    const models = `${d.models} model${d.models === 1 ? "" : "s"}`;
    legend.appendChild(el("span", "muted", `of memory.budget ${fmtBytes(d.budget_bytes)}, ${models}`));
    card.append(head, bar(parts, d.budget_bytes), legend);
    box.appendChild(card);
  }
}

function modelCells(m, nowS) {
  const loaded = m.state === "loaded";
  const expiry = !loaded ? "" : m.expires_at !== null ? fmtUntil(m.expires_at, nowS)
    : m.keep_alive_s < 0 ? "never" : "in use";
  const state = m.state === "loading" ? `loading ${Math.round(100 * m.load_progress)}%` : m.state;
  return [m.name, m.device || "", state, [fmtBytes(m.size_bytes), ""],
          loaded ? [`${m.kv_blocks_used} / ${m.kv_blocks_total}`, "num"] : "",
          loaded ? m.running : "", loaded ? m.queued : "", loaded ? [fmtRate(m.tokens_per_s), "num"] : "", expiry];
}

function unloadButton(cell, m) {
  if (!view.status.admin || m.state !== "loaded") { cell.replaceChildren(); return; }
  if (cell.firstChild) return;
  const button = el("button", "unload", "Unload");
  button.type = "button";
  button.addEventListener("click", () => unload(m.name));
  cell.appendChild(button);
}

function renderModels(status) {
  const page = status.models;
  $("models-count").textContent = countText(page);
  syncRows($("models").tBodies[0], page.rows, (m) => `${m.name}@${m.device}`, (m) => modelCells(m, status.time),
           unloadButton);
  renderPager("models-pager", view.models, page);
}

function renderTenants(status) {
  const page = status.tenants;
  $("tenants-count").textContent = countText(page);
  syncRows($("tenants").tBodies[0], page.rows, (t) => t.name, (t) => {
    const ceiling = t.kv_limit_bytes || t.kv_reserved_bytes;  // neither: nothing to hold it against
    return [t.name, [fmtBytes(t.kv_used_bytes), "num"], [fmtBytes(t.kv_reserved_bytes), "num"],
            [fmtBytes(t.kv_limit_bytes), "num"], ceiling ? bar([["kv", t.kv_used_bytes]], ceiling, true) : "",
            t.running, t.queued, t.rejected_last_minute];
  });
  renderPager("tenants-pager", view.tenants, page);
}

function renderCharts(status) {
  const cutoff = status.time - 300;
  view.history = view.history.concat(status.history).filter((s) => s.t >= cutoff);
  if (view.history.length) view.lastSampleS = view.history[view.history.length - 1].t;
  const last = view.history[view.history.length - 1];
  if (last) {
    const secs = (v) => (v === null ? "–" : v.toFixed(3));
    $("now-tokens").textContent = fmtRate(last.tokens_per_s);
    $("now-ttft").textContent = `${secs(last.ttft_p50_s)} / ${secs(last.ttft_p99_s)}`;
    $("now-queue").textContent = `${last.queued} / ${last.running}`;
    $("now-kv").textContent = (100 * last.kv_used_fraction).toFixed(1) + "%";
  }
  drawCharts(view.history, status.time);
}

function render(status) {
  view.status = status;
  $("key-panel").hidden = !status.tenants_enabled || status.admin;
  $("forget-key").hidden = !apiKey();
  $("phase").textContent = status.phase;
  $("phase").className = "pill " + status.phase;
  $("who").textContent = !status.tenants_enabled ? "no tenants: open to whoever may call the API"
    : status.admin ? `admin (tenant ${status.tenant})` : `tenant ${status.tenant}`;
  $("updated").textContent = "updated " + new Date(status.time * 1000).toLocaleTimeString();
  $("node").hidden = false;
  for (const node of document.querySelectorAll(".admin-only")) node.hidden = !status.admin;
  $("devices-panel").hidden = $("charts-panel").hidden = !status.admin;
  if (status.admin) {
    renderDevices(status.devices);
    renderCharts(status);
  }
  renderModels(status);
  renderTenants(status);
  if (status.admin && view.catalog) renderCatalog();
}

function statusUrl() {
  const q = new URLSearchParams({since: String(view.lastSampleS), model_filter: view.models.filter,
                                 model_offset: String(view.models.offset), tenant_filter: view.tenants.filter,
                                 tenant_offset: String(view.tenants.offset)});
  return "/api/status?" + q.toString();
}

async function errorText(response) {
  try { return (await response.json()).error || response.statusText; } catch (e) { return response.statusText; }
}

async function poll() {
  clearTimeout(view.timer);
  let response;
  try {
    response = await fetch(statusUrl(), {headers: authHeaders(), cache: "no-store"});
  } catch (e) {
    $("phase").textContent = "offline";
    $("phase").className = "pill offline";
    view.timer = setTimeout(poll, POLL_INTERVAL_MS);
    return;
  }
  if (response.status === 401) {  // no key, or a wrong one: show nothing of the node, wait for a key
    const message = await errorText(response);
    $("node").hidden = true;
    view.history = [];
    view.lastSampleS = 0;
    $("key-panel").hidden = false;
    $("phase").textContent = "key needed";
    $("phase").className = "pill";
    $("forget-key").hidden = !apiKey();
    showError(apiKey() ? message : "");
    return;
  }
  if (!response.ok) {
    showError(`${response.status}: ${await errorText(response)}`);
  } else {
    showError("");
    render(await response.json());
  }
  view.timer = setTimeout(poll, POLL_INTERVAL_MS);
}

function pollSoon() { clearTimeout(view.timer); view.timer = setTimeout(poll, 0); }

async function post(path, body) {
  return fetch(path, {method: "POST", headers: authHeaders({"Content-Type": "application/json"}),
                      body: JSON.stringify(body)});
}

async function unload(name) {
  if (!window.confirm(`Unload ${name}? Requests for it will load it again.`)) return;
  $("action-status").textContent = `unloading ${name}…`;
  const response = await post("/api/generate", {model: name, keep_alive: 0, stream: false});
  $("action-status").textContent = response.ok ? `unloaded ${name}` : `unload ${name}: ${await errorText(response)}`;
  view.catalog = null;
  pollSoon();
}

async function load(name) {
  if (!window.confirm(`Load ${name}? It may unload idle models to make room.`)) return;
  const status = $("action-status");
  status.textContent = `loading ${name}…`;
  const response = await post("/api/load", {model: name});
  if (!response.ok) { status.textContent = `load ${name}: ${await errorText(response)}`; return; }
  const reader = response.body.getReader(), decoder = new TextDecoder();
  let buffered = "", last = null;
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffered += decoder.decode(value, {stream: true});
    const lines = buffered.split("\n");
    buffered = lines.pop();
    for (const line of lines.filter(Boolean)) {
      last = JSON.parse(line);
      status.textContent = last.error ? `load ${name}: ${last.error}`
        : last.status === "success" ? `loaded ${name} in ${(last.load_duration / 1e9).toFixed(2)}s`
        : `${last.status} ${name}: ${fmtBytes(last.completed)} of ${fmtBytes(last.total)}`;
    }
  }
  view.catalog = null;
  pollSoon();
}

async function listCatalog() {
  const response = await fetch("/api/tags", {headers: authHeaders(), cache: "no-store"});
  if (!response.ok) { $("action-status").textContent = `list models: ${await errorText(response)}`; return; }
  view.catalog = (await response.json()).models;
  renderCatalog();
}

function renderCatalog() {
  const needle = $("catalog-filter").value.toLowerCase();
  const rows = view.catalog.filter((m) => m.state !== "loaded" && m.name.toLowerCase().includes(needle));
  $("catalog-count").textContent = rows.length > CATALOG_ROWS ? `first ${CATALOG_ROWS} of ${rows.length}`
    : `${rows.length} not loaded`;
  syncRows($("catalog").tBodies[0], rows.slice(0, CATALOG_ROWS), (m) => m.name,
           (m) => [m.name, m.state, [fmtBytes(m.size), "num"]], (cell, m) => {
             if (cell.firstChild) return;
             const button = el("button", "load", "Load");
             button.type = "button";
             button.addEventListener("click", () => load(m.name));
             cell.appendChild(button);
           });
}

function start() {
  $("key-use").addEventListener("click", () => {
    const key = $("key-input").value.trim();
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    $("key-input").value = "";
    pollSoon();
  });
  $("key-input").addEventListener("keydown", (e) => { if (e.key === "Enter") $("key-use").click(); });
  $("forget-key").addEventListener("click", () => { sessionStorage.removeItem(KEY_STORAGE); pollSoon(); });
  for (const [id, state] of [["models-filter", view.models], ["tenants-filter", view.tenants]]) {
    $(id).addEventListener("input", (e) => { state.filter = e.target.value; state.offset = 0; pollSoon(); });
  }
  $("catalog-refresh").addEventListener("click", listCatalog);
  $("catalog-filter").addEventListener("input", () => { if (view.catalog) renderCatalog(); });
  poll();
}

start();
