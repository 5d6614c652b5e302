// lockgate viewer: sessions list, session view, run dashboard; plain JS, no build step.
"use strict";

const $ = (sel, el = document) => el.querySelector(sel);
const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
const POLL_MS = 1000;

const state = {
  filters: {}, cursor: null, next: null, rows: new Map(), selected: null, detail: null,
  colour: "logprob", mask: true, view: "sessions", polling: false,
};

// ---- colours (tests/browser/test_viewer_browser.py recomputes these from the stored values) --------
function logprobColour(lp) {
  const p = Math.min(1, Math.max(0, Math.exp(lp)));
  return `hsl(${(120 * p).toFixed(1)}, 75%, 80%)`;
}
function versionColour(v) {
  if (v < 0) return "hsl(0, 0%, 85%)";
  return `hsl(${((v * 137.508) % 360).toFixed(1)}, 65%, 78%)`;
}
window.lockgateViewer = { logprobColour, versionColour, state };

async function api(path) {
  const r = await fetch(path, { credentials: "same-origin", headers: { accept: "application/json" } });
  if (r.status === 401) { location.href = "./"; throw new Error("signed out"); }
  const body = await r.json();
  if (!r.ok) throw new Error(body.error ? body.error.message : r.statusText);
  return body;
}
function qs(params) {
  const u = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== "" && v !== null && v !== undefined) u.set(k, v);
  return u.toString();
}
const fmt = (x, d = 3) => (x === null || x === undefined || Number.isNaN(x) ? "–" : Number(x).toFixed(d).replace(/\.?0+$/, "") || "0");
function age(t) {
  const s = Date.now() / 1000 - t;
  if (s < 60) return `${Math.max(0, Math.round(s))}s`;
  if (s < 3600) return `${Math.round(s / 60)}m`;
  if (s < 86400) return `${Math.round(s / 3600)}h`;
  return `${Math.round(s / 86400)}d`;
}

// ---- header -------------------------------------------------------------------------------
async function loadOverview() {
  const o = await api("api/overview");
  $("#title").textContent = o.title + (o.extra && o.extra.read_only ? " (read-only)" : "");
  const st = o.by_status;
  $("#counts").textContent = `${o.sessions} sessions (${st.open || 0} open) · ${o.calls} calls`;
  if (o.gateway) {
    const g = o.gateway;
    $("#gw").textContent = `v${g.version} · ${g.state} · ${g.in_flight} in flight · ${g.interruptions} interrupted`;
  }
  $("#tasks").innerHTML = o.tasks.map((t) => `<option value="${esc(t)}">`).join("");
  return o;
}

// ---- sessions list -------------------------------------------------------------------------
function rowHtml(s) {
  const versions = s.first_version === null ? "–" : s.first_version === s.last_version ? `${s.first_version}` : `${s.first_version}–${s.last_version}`;
  return `<td class="id" title="${esc(s.id)}">${esc(s.id.slice(0, 8))}</td><td>${esc(s.task_id)}</td>` +
    `<td>${esc(s.group_id || "")}</td><td class="st-${esc(s.status)}">${esc(s.status)}</td>` +
    `<td>${fmt(s.reward)}</td><td>${s.num_calls}</td><td>${versions}</td>` +
    `<td>${s.interruptions || ""}</td><td>${s.rerender_splits || ""}</td><td data-t="${s.created_at}">${age(s.created_at)}</td>`;
}
function putRow(s, where) {
  const tbody = $("#sessions tbody");
  let tr = tbody.querySelector(`tr[data-id="${CSS.escape(s.id)}"]`);
  if (tr) { tr.innerHTML = rowHtml(s); }
  else {
    tr = document.createElement("tr");
    tr.dataset.id = s.id;
    tr.innerHTML = rowHtml(s);
    if (where === "top") { tbody.prepend(tr); tr.classList.add("new"); }
    else tbody.append(tr);
  }
  tr.dataset.created = s.created_at;
  tr.classList.toggle("sel", s.id === state.selected);
  state.rows.set(s.id, s);
}
async function loadSessions(append = false) {
  const params = { ...state.filters, limit: 50 };
  if (append && state.next) params.cursor = state.next;
  $("#filter-error").textContent = "";
  let page;
  try { page = await api("api/sessions?" + qs(params)); }
  catch (e) { $("#filter-error").textContent = e.message; return; }
  if (!append) { $("#sessions tbody").innerHTML = ""; state.rows.clear(); }
  for (const s of page.sessions) putRow(s, "bottom");
  state.next = page.next_cursor;
  $("#more").hidden = !state.next;
  $("#empty").hidden = state.rows.size > 0;
}
function readFilters() {
  const f = {};
  for (const el of $("#filters").elements) if (el.name && el.value.trim() !== "") f[el.name] = el.value.trim();
  return f;
}

// ---- live feed ------------------------------------------------------------------------------
async function poll() {
  if (!state.cursor) return;
  try {
    const ch = await api("api/changes?" + qs({ ...state.filters, cursor: state.cursor }));
    state.cursor = ch.cursor;
    $("#live").className = "live on";
    if (ch.truncated) { await loadSessions(); }
    else {
      const oldest = Math.min(...[...state.rows.values()].map((r) => r.created_at));
      for (const s of ch.sessions.slice().reverse()) {
        if (state.rows.has(s.id)) putRow(s);
        else if (!state.next || s.created_at >= oldest) putRow(s, "top");
      }
      if (ch.sessions.length) $("#empty").hidden = true;
    }
    if (state.selected && ch.changed.includes(state.selected)) await showSession(state.selected, true);
    if (ch.changed.length && Date.now() - (state.overviewAt || 0) > 5000) {
      state.overviewAt = Date.now();
      loadOverview().catch(() => {});
    }
  } catch (e) {
    $("#live").className = "live err";
    $("#live").title = "live feed: " + e.message;
  }
}
async function pollLoop() {
  if (state.polling) return;
  state.polling = true;
  for (;;) {
    await new Promise((r) => setTimeout(r, document.hidden ? 5 * POLL_MS : POLL_MS));
    await poll();
    if (state.view === "dashboard" && Date.now() - (state.dashAt || 0) > 5000) loadDashboard().catch(() => {});
  }
}

// ---- session view ----------------------------------------------------------------------------
function tokenText(d, id) {
  const t = d.tokens[id];
  if (t === undefined || t === "") return `⟨${id}⟩`;  // no tokenizer, or a bare byte piece
  return t.replace(/\n/g, "↵\n");
}
function tokColour(lp, v) { return state.colour === "version" ? versionColour(v) : logprobColour(lp); }
const PROMPT_EDGE = 200;  // a long prompt shows its first and last 200 tokens until asked
function callTokens(d, c, ci, full = false) {
  const out = [], n = c.prompt_ids.length, elide = !full && n > 3 * PROMPT_EDGE;
  for (let i = 0; i < n; i++) {
    if (elide && i === PROMPT_EDGE) {
      out.push(`<button class="elided" data-c="${ci}">… ${n - 2 * PROMPT_EDGE} prompt tokens: show</button>`);
      i = n - PROMPT_EDGE;
    }
    const id = c.prompt_ids[i];
    out.push(`<span class="t p" data-c="${ci}" data-k="p${i}">${esc(tokenText(d, id))}</span>`);
  }
  const cuts = new Set(c.cuts);
  for (let i = 0; i < c.completion_ids.length; i++) {
    const id = c.completion_ids[i], lp = c.logprobs[i], v = c.versions[i];
    if (cuts.has(i)) out.push(`<span class="cutmark" data-label="v${c.versions[i - 1]}→v${v}" title="weight sync: version ${c.versions[i - 1]} → ${v}"></span>`);
    out.push(`<span class="t s m${c.loss_mask[i]}" data-c="${ci}" data-k="s${i}" data-id="${id}" data-lp="${lp}" data-v="${v}" style="background:${tokColour(lp, v)}">${esc(tokenText(d, id))}</span>`);
  }
  return out.join("");
}
function messageHtml(m) {
  const cls = m.role === "tool" ? "tool" : m.role;
  const label = m.role === "tool" ? `tool result${m.tool_call_id ? " " + m.tool_call_id : ""}${m.name ? " (" + m.name + ")" : ""}` : m.role;
  const tcs = (m.tool_calls || []).map((tc) => {
    const f = tc.function || {};
    return `<span class="tc">tool call ${esc(f.name || "?")}(${esc(f.arguments || "")})</span>`;
  }).join("");
  return `<div class="msg ${esc(cls)}"><span class="role">${esc(label)}</span>${esc(m.content)}${tcs}</div>`;
}
function callHtml(d, c, ci) {
  const flags = [];
  if (c.split) flags.push('<span class="flag split" title="the prompt did not extend the previous sample\'s tokens: a new training sample starts here">re-render split</span>');
  else if (c.new_sample) flags.push('<span class="flag">sample start</span>');
  if (c.interruptions) flags.push(`<span class="flag cut" title="cut by a weight sync and resumed">interrupted ×${c.interruptions}</span>`);
  if (!c.trained) flags.push('<span class="flag nomask" title="never answered to the agent: not trained on">not trained</span>');
  if (c.constrained) flags.push('<span class="flag constrained" title="sampled under a grammar">constrained</span>');
  const elided = c.prompt_total - c.prompt_ids.length;
  const dur = (c.ended_at - c.started_at).toFixed(2);
  return `<div class="call" id="call-${c.index}"><div class="head"><b>call ${c.index}</b>` +
    `<span>${c.finish_reason}</span><span>${dur}s</span><span class="mono">${esc(c.replica)}</span>` +
    `<span>prompt ${c.prompt_total}${elided ? ` (${elided} shown above)` : ""} · sampled ${c.completion_ids.length}</span>` +
    (c.tools.length ? `<span>tools: ${esc(c.tools.join(", "))}</span>` : "") + flags.join("") + "</div>" +
    (c.messages.length ? `<div class="msgs">${c.messages.map(messageHtml).join("")}</div>` : "") +
    `<div class="toks${state.mask ? " mask" : ""}">${callTokens(d, c, ci)}</div></div>`;
}
function legendHtml() {
  if (state.colour === "version") {
    const vs = new Set();
    for (const c of state.detail.calls) for (const v of c.versions) vs.add(v);
    return [...vs].sort((a, b) => a - b).map((v) => `<i style="background:${versionColour(v)}"></i>v${v}`).join(" ");
  }
  return "p=0 " + [0, 0.25, 0.5, 0.75, 1].map((p) => `<i style="background:${logprobColour(Math.log(p || 1e-9))}"></i>`).join("") + " p=1";
}
// How the run computes advantages, as the group table's heading says it.
function advantageName(spec) {
  const names = { grpo: "GRPO", grpo_no_std: "GRPO without std", rloo: "RLOO", dr_grpo: "Dr. GRPO" };
  const name = names[spec.estimator] || spec.estimator;
  return spec.negative_advantage_weight === 1 ? name : `${name}, negatives × ${fmt(spec.negative_advantage_weight)}`;
}
function renderDetail() {
  const d = state.detail, s = d.session;
  const adv = d.group.map((g) => `<tr class="${g.id === s.id ? "self" : ""}" data-id="${esc(g.id)}"><td class="mono">${esc(g.id.slice(0, 8))}</td>` +
    `<td class="st-${esc(g.status)}">${esc(g.status)}</td><td>${fmt(g.reward)}</td><td>${fmt(g.advantage)}</td></tr>`).join("");
  const pane = $("#detail-pane");
  const keepScroll = pane.scrollTop;
  pane.innerHTML =
    `<h3 class="mono">${esc(s.id)}</h3><div class="kv">` +
    `<span><b>task</b>${esc(s.task_id)}</span><span><b>group</b>${esc(s.group_id || "–")}</span>` +
    `<span><b>status</b><span class="st-${esc(s.status)}">${esc(s.status)}</span></span><span><b>reward</b><span id="reward">${fmt(s.reward, 4)}</span></span>` +
    `<span><b>calls</b>${s.num_calls}</span><span><b>samples</b>${d.samples}</span><span><b>splits</b>${s.rerender_splits}</span>` +
    `<span><b>interruptions</b>${s.interruptions}</span><span><b>versions</b>${s.first_version ?? "–"}…${s.last_version ?? "–"}</span>` +
    (s.error ? `<span class="err"><b>error</b>${esc(s.error)}</span>` : "") + "</div>" +
    `<div class="controls"><label>colour by <select id="colour"><option value="logprob">logprob</option><option value="version">weight version</option></select></label>` +
    `<label><input type="checkbox" id="mask"${state.mask ? " checked" : ""}> underline the loss mask</label>` +
    `<span class="legend" id="legend">${legendHtml()}</span></div>` +
    `<details${d.group.length > 1 ? " open" : ""}><summary>group (${d.group.length}) rewards and advantages (${esc(advantageName(d.advantages))})</summary>` +
    `<table class="group"><thead><tr><th>session</th><th>status</th><th>reward</th><th title="as the run trains them: failed and open sessions are left out, as the coordinator leaves them out">advantage</th></tr></thead><tbody>${adv}</tbody></table></details>` +
    `<details><summary>metadata</summary><pre class="mono">${esc(JSON.stringify(d.metadata, null, 2))}</pre></details>` +
    d.calls.map((c, ci) => callHtml(d, c, ci)).join("");
  pane.scrollTop = keepScroll;
  $("#colour").value = state.colour;
  $("#colour").onchange = (e) => { state.colour = e.target.value; recolour(); };
  $("#mask").onchange = (e) => { state.mask = e.target.checked; for (const el of pane.querySelectorAll(".toks")) el.classList.toggle("mask", state.mask); };
  for (const tr of pane.querySelectorAll("table.group tbody tr")) tr.onclick = () => selectSession(tr.dataset.id);
  pane.onclick = (e) => {
    const b = e.target.closest("button.elided");
    if (!b) return;
    const ci = Number(b.dataset.c);
    b.parentElement.innerHTML = callTokens(state.detail, state.detail.calls[ci], ci, true);
  };
}
function recolour() {
  for (const el of $("#detail-pane").querySelectorAll(".t.s")) el.style.background = tokColour(Number(el.dataset.lp), Number(el.dataset.v));
  $("#legend").innerHTML = legendHtml();
}
async function showSession(id, refresh = false) {
  let d;
  try { d = await api("api/sessions/" + encodeURIComponent(id)); }
  catch (e) { $("#detail-pane").innerHTML = `<p class="err">${esc(e.message)}</p>`; return; }
  if (state.selected !== id) return;
  state.detail = d;
  renderDetail();
  if (refresh && state.rows.has(id)) putRow(d.session);
}
function selectSession(id) {
  state.selected = id;
  for (const tr of document.querySelectorAll("#sessions tbody tr")) tr.classList.toggle("sel", tr.dataset.id === id);
  if (location.hash !== "#session=" + id) history.replaceState(null, "", "#session=" + id);
  showSession(id);
}

// ---- token tooltip ------------------------------------------------------------------------------
function tokenInfo(el) {
  const c = state.detail.calls[Number(el.dataset.c)];
  const k = el.dataset.k, i = Number(k.slice(1));
  if (k[0] === "p") {
    const id = c.prompt_ids[i];
    return `prompt token · call ${c.index}\nid ${id}\ntext ${JSON.stringify(state.detail.tokens[id] ?? null)}\nloss mask 0`;
  }
  const id = c.completion_ids[i];
  return `sampled token ${i} · call ${c.index}\nid ${id}\ntext ${JSON.stringify(state.detail.tokens[id] ?? null)}\n` +
    `logprob ${c.logprobs[i].toFixed(4)} (p ${Math.exp(c.logprobs[i]).toFixed(3)})\nversion ${c.versions[i]}\nloss mask ${c.loss_mask[i]}`;
}
document.addEventListener("mouseover", (e) => {
  const el = e.target.closest && e.target.closest(".t");
  const tip = $("#tip");
  if (!el || !state.detail) { tip.hidden = true; return; }
  tip.textContent = tokenInfo(el);
  tip.hidden = false;
  const r = el.getBoundingClientRect();
  tip.style.left = Math.min(r.left, innerWidth - 300) + "px";
  tip.style.top = (r.bottom + 6 + 120 > innerHeight ? r.top - 110 : r.bottom + 6) + "px";
});

// ---- dashboard ----------------------------------------------------------------------------------------
const PALETTE = ["#3182ce", "#e53e3e", "#38a169", "#d69e2e", "#805ad5", "#dd6b20", "#319795", "#718096"];
function chart(title, steps, opts) {
  // opts: lines [{name, data, colour, dots}], band [lo, hi], bars [{name, data, colour}] (stacked), yMax
  const W = 460, H = 220, L = 46, R = 8, T = 8, B = 22;
  const all = [];
  for (const s of opts.lines || []) for (const v of s.data) if (v !== null) all.push(v);
  if (opts.band) for (const arr of opts.band) for (const v of arr) if (v !== null) all.push(v);
  if (opts.bars) steps.forEach((_, i) => all.push(opts.bars.reduce((a, b) => a + (b.data[i] || 0), 0)));
  let lo = Math.min(0, ...all), hi = opts.yMax ?? Math.max(...all, 1e-9);
  if (hi === lo) hi = lo + 1;
  const n = steps.length, x0 = steps[0] ?? 0, x1 = steps[n - 1] ?? 1;
  const X = (s) => L + (x1 === x0 ? 0.5 : (s - x0) / (x1 - x0)) * (W - L - R);
  const Y = (v) => T + (1 - (v - lo) / (hi - lo)) * (H - T - B);
  let svg = "";
  for (let k = 0; k <= 4; k++) {
    const v = lo + (k / 4) * (hi - lo);
    svg += `<line x1="${L}" x2="${W - R}" y1="${Y(v)}" y2="${Y(v)}" stroke="#eef0f3"/><text x="${L - 4}" y="${Y(v) + 3}" text-anchor="end">${fmt(v, 2)}</text>`;
  }
  for (const s of [x0, x1]) svg += `<text x="${X(s)}" y="${H - 6}" text-anchor="middle">${s}</text>`;
  svg += `<text x="${(L + W) / 2}" y="${H - 6}" text-anchor="middle">step</text>`;
  if (opts.bars) {
    const bw = Math.max(1, ((W - L - R) / Math.max(n, 1)) * 0.7);
    steps.forEach((s, i) => {
      let acc = 0;
      for (const b of opts.bars) {
        const v = b.data[i] || 0;
        if (v > 0) svg += `<rect x="${X(s) - bw / 2}" width="${bw}" y="${Y(acc + v)}" height="${Math.max(0.5, Y(acc) - Y(acc + v))}" fill="${b.colour}"><title>step ${s} ${esc(b.name)}: ${fmt(v, 4)}</title></rect>`;
        acc += v;
      }
    });
  }
  if (opts.band) {
    const [a, b] = opts.band;
    const pts = steps.map((s, i) => [s, a[i], b[i]]).filter((p) => p[1] !== null && p[2] !== null);
    if (pts.length) svg += `<polygon fill="#3182ce22" points="${pts.map((p) => `${X(p[0])},${Y(p[2])}`).concat(pts.slice().reverse().map((p) => `${X(p[0])},${Y(p[1])}`)).join(" ")}"/>`;
  }
  for (const s of opts.lines || []) {
    const pts = steps.map((st, i) => [st, s.data[i]]).filter((p) => p[1] !== null);
    if (!s.dots) svg += `<polyline fill="none" stroke="${s.colour}" stroke-width="1.6" points="${pts.map((p) => `${X(p[0])},${Y(p[1])}`).join(" ")}"/>`;
    if (s.dots || pts.length < 40) for (const p of pts) svg += `<circle cx="${X(p[0])}" cy="${Y(p[1])}" r="${s.dots ? 3.5 : 2}" fill="${s.colour}"><title>step ${p[0]} ${esc(s.name)}: ${fmt(p[1], 4)}</title></circle>`;
  }
  const keys = [...(opts.lines || []), ...(opts.bars || [])].map((s) => `<span><i style="background:${s.colour}"></i>${esc(s.name)}</span>`).join("");
  return `<div class="chart"><h3>${esc(title)}</h3><svg viewBox="0 0 ${W} ${H}" preserveAspectRatio="none">${svg}</svg><div class="keys">${keys}</div></div>`;
}
async function loadDashboard() {
  state.dashAt = Date.now();
  const m = await api("api/metrics");
  if (!m.available) {
    $("#charts").innerHTML = "";
    $("#dash-summary").innerHTML = "";
    $("#dash-note").textContent = m.error
      ? `The run metrics cannot be read: ${m.error}`
      : `No run metrics yet (${m.path || "no metrics.jsonl"}): the dashboard fills in as the trainer logs steps.`;
    return;
  }
  const c = m.columns, st = m.steps, last = (a) => { for (let i = a.length - 1; i >= 0; i--) if (a[i] !== null) return a[i]; return null; };
  $("#dash-note").textContent = `${m.path} · ${st.length} steps · refreshed ${new Date().toLocaleTimeString()}`;
  const valSteps = st.map((s, i) => (c["val/reward_mean"][i] !== null ? c["val/reward_mean"][i] : null));
  $("#dash-summary").innerHTML = [
    ["steps", st[st.length - 1] ?? "–"], ["reward (last)", fmt(last(c["reward/mean"]))], ["validation (last)", fmt(last(c["val/reward_mean"]))],
    ["staleness max", fmt(last(c["staleness/max"]), 0)], ["gen tok/s (last)", fmt(last(c["perf/gen_tokens_per_s"]), 0)],
    ["trainer idle (last)", last(m.trainer_idle_frac) === null ? "–" : `${Math.round(100 * last(m.trainer_idle_frac))}%`],
    ["stale drops", fmt(last(c["count/groups_dropped/stale"]), 0)],
  ].map(([k, v]) => `<div>${esc(k)}<b>${esc(v)}</b></div>`).join("");
  const stal = new Set();
  for (const h of m.staleness_hist) for (const k of Object.keys(h)) stal.add(Number(k));
  const stalKeys = [...stal].sort((a, b) => a - b);
  const stalBars = stalKeys.map((k, j) => ({
    name: `${k} behind`, colour: `hsl(${Math.max(0, 130 - 40 * k)}, 60%, ${55 + 5 * (j % 2)}%)`,
    data: m.staleness_hist.map((h) => { const tot = Object.values(h).reduce((a, b) => a + b, 0); return tot ? (h[String(k)] || 0) / tot : 0; }),
  }));
  const charts = [
    chart("Reward (mean, min–max band) and validation", st, { band: [c["reward/min"], c["reward/max"]], lines: [
      { name: "train reward mean", data: c["reward/mean"], colour: PALETTE[0] },
      { name: "validation reward (greedy)", data: valSteps, colour: PALETTE[1], dots: true }] }),
    stalBars.length
      ? chart("Staleness histogram per step (share of trained tokens)", st, { bars: stalBars, yMax: 1 })
      : chart("Staleness", st, { lines: [{ name: "mean", data: c["staleness/mean"], colour: PALETTE[2] }, { name: "max", data: c["staleness/max"], colour: PALETTE[1] }] }),
    chart("Generation throughput (tokens/s)", st, { lines: [{ name: "gen tokens/s", data: c["perf/gen_tokens_per_s"], colour: PALETTE[2] }] }),
    chart("Idle fractions", st, { yMax: 1, lines: [{ name: "trainer idle", data: m.trainer_idle_frac, colour: PALETTE[3] },
      ...(c["perf/replica_idle_frac"].some((v) => v !== null) ? [{ name: "replica idle", data: c["perf/replica_idle_frac"], colour: PALETTE[4] }] : [])] }),
    chart("Weight sync per step (s): pause, load, resume; staging ran while serving", st, { bars: [
      { name: "pause", data: c["sync/pause_latency_s"], colour: "#e53e3e" }, { name: "load", data: c["sync/load_s"], colour: "#3182ce" },
      { name: "resume", data: c["sync/resume_s"], colour: "#38a169" }, { name: "stage (overlapped)", data: c["sync/stage_s"], colour: "#cbd5e0" }] }),
    chart("Stale drops and interruptions per step", st, { bars: [{ name: "groups dropped as stale", data: m.stale_drops, colour: "#dd6b20" }],
      lines: [{ name: "calls interrupted by the sync", data: c["sync/interrupted"], colour: PALETTE[4] }] }),
  ];
  $("#charts").innerHTML = charts.join("");
}

// ---- routing and start-up --------------------------------------------------------------------
function route() {
  const h = location.hash;
  state.view = h === "#dashboard" ? "dashboard" : "sessions";
  $("#view-sessions").hidden = state.view !== "sessions";
  $("#view-dashboard").hidden = state.view !== "dashboard";
  $("#tab-sessions").classList.toggle("on", state.view === "sessions");
  $("#tab-dashboard").classList.toggle("on", state.view === "dashboard");
  if (state.view === "dashboard") loadDashboard().catch((e) => { $("#dash-note").textContent = e.message; });
  const m = h.match(/^#session=(.+)$/);
  if (m && m[1] !== state.selected) selectSession(decodeURIComponent(m[1]));
}
async function start() {
  $("#filters").onsubmit = (e) => { e.preventDefault(); state.filters = readFilters(); loadSessions(); };
  $("#clear").onclick = () => { $("#filters").reset(); state.filters = {}; loadSessions(); };
  $("#more").onclick = () => loadSessions(true);
  $("#sessions tbody").onclick = (e) => { const tr = e.target.closest("tr"); if (tr) selectSession(tr.dataset.id); };
  window.onhashchange = route;
  const o = await loadOverview();
  state.cursor = o.cursor;
  await loadSessions();
  route();
  setInterval(() => { for (const td of document.querySelectorAll("td[data-t]")) td.textContent = age(Number(td.dataset.t)); }, 10000);
  document.body.dataset.ready = "1";
  pollLoop();
}
start();
