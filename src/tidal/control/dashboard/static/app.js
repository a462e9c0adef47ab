// The Tidal dashboard: a login form, then four views fed by one server-sent
// event stream (/dashboard/api/stream). The token stays in this tab's
// sessionStorage and goes in an Authorization header; every datum is put in
// the page as text, never as HTML.
(() => {
"use strict";

const { timeChart, fmtNum, clockTime } = window.TidalCharts;
const TOKEN_KEY = "tidal.token";
const FINISHED = new Set(["completed", "failed", "cancelled", "dropped"]);
const state = { token: null, me: null, snap: null, route: { view: "cluster" }, sort: { key: "submit_time", dir: 1 },
                stream: null, streamJob: undefined };

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") e.className = v;
    else if (k === "dataset") Object.assign(e.dataset, v);
    else e.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children) if (c !== null && c !== undefined) e.append(c instanceof Node ? c : String(c));
  return e;
}

// -- login -------------------------------------------------------------------------------------------------------
function showLogin(error) {
  stopStream();
  state.token = null;
  sessionStorage.removeItem(TOKEN_KEY);
  $("app").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = error || "";
  $("token").value = "";
  $("token").focus();
}

async function login(token) {
  let r;
  try {
    r = await fetch("/dashboard/api/me", { headers: { Authorization: `Bearer ${token}` }, cache: "no-store" });
  } catch (e) {
    showLogin("The server does not answer.");
    return;
  }
  if (r.status === 401) return showLogin("That token is not valid.");
  if (r.status === 403) return showLogin("That token cannot use the dashboard (use the admin's or a tenant's).");
  if (!r.ok) return showLogin(`The server answered ${r.status}.`);
  state.token = token;
  state.me = await r.json();
  sessionStorage.setItem(TOKEN_KEY, token);
  $("login").hidden = true;
  $("app").hidden = false;
  $("whoami").textContent = `${state.me.name} (${state.me.role})`;
  route();
}

// -- the stream ----------------------------------------------------------------------------------------------------
function stopStream() {
  if (state.stream) state.stream.abort();
  state.stream = null;
}

function startStream(jobId) {
  stopStream();
  const ctrl = new AbortController();
  state.stream = ctrl;
  state.streamJob = jobId;
  const url = "/dashboard/api/stream" + (jobId ? `?job=${encodeURIComponent(jobId)}` : "");
  readStream(url, ctrl).catch(() => {});
}

async function readStream(url, ctrl) {
  while (!ctrl.signal.aborted) {
    try {
      const r = await fetch(url, { headers: { Authorization: `Bearer ${state.token}` }, signal: ctrl.signal,
                                   cache: "no-store" });
      if (r.status === 401 || r.status === 403) return showLogin("Your token is no longer valid.");
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      setLive("live", "ok");
      const reader = r.body.getReader();
      const dec = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += dec.decode(value, { stream: true });
        let i;
        while ((i = buf.indexOf("\n\n")) >= 0) {
          const msg = buf.slice(0, i);
          buf = buf.slice(i + 2);
          if (onMessage(msg) === "auth") return showLogin("Your token is no longer valid.");
        }
      }
    } catch (e) {
      if (ctrl.signal.aborted) return;
    }
    setLive("reconnecting…", "down");
    await new Promise((res) => setTimeout(res, 2000));
  }
}

function onMessage(msg) {
  let event = "message", data = "";
  for (const line of msg.split("\n")) {
    if (line.startsWith("event:")) event = line.slice(6).trim();
    else if (line.startsWith("data:")) data += line.slice(5).trim();
  }
  if (event === "auth") return "auth";
  if (!data) return null;
  state.snap = JSON.parse(data);
  render();
  return null;
}

function setLive(text, cls) {
  $("live").textContent = text;
  $("live").className = `live ${cls}`;
}

// -- routing --------------------------------------------------------------------------------------------------------
function parseRoute() {
  const h = location.hash.replace(/^#\/?/, "");
  const [view, ...rest] = h.split("/");
  if (view === "job" && rest.length) return { view: "job", id: decodeURIComponent(rest.join("/")) };
  return { view: ["cluster", "jobs", "scheduler"].includes(view) ? view : "cluster" };
}

function route() {
  if (!state.token) return;
  state.route = parseRoute();
  for (const v of ["cluster", "jobs", "job", "scheduler"]) $(`view-${v}`).hidden = v !== state.route.view;
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.route === state.route.view);
  const jobId = state.route.view === "job" ? state.route.id : null;
  if (!state.stream || state.streamJob !== jobId) {
    if (state.snap) state.snap.job = undefined;
    delete $("scale-gpus").dataset.edited;
    startStream(jobId);
  }
  if (state.snap) render();
}

function render() {
  const s = state.snap;
  if (!s) return;
  const v = state.route.view;
  if (v === "cluster") renderCluster(s);
  else if (v === "jobs") renderJobs(s);
  else if (v === "job") renderJob(s);
  else if (v === "scheduler") renderScheduler(s);
}

// -- helpers -------------------------------------------------------------------------------------------------------
function jobColor(id) {
  let h = 0;
  for (const c of id) h = (h * 31 + c.charCodeAt(0)) >>> 0;
  return `hsl(${h % 360}, 65%, 55%)`;
}

function relTime(t, now) {
  if (t === null || t === undefined) return "–";
  const d = t - now, txt = relSpan(Math.abs(d));
  return d >= 0 ? `in ${txt}` : `${txt} ago`;
}

function progressOf(j) {
  // the step it reached (a finished job: the step it ended at) of its iterations, as `tidal jobs` counts it;
  // null when there is no such share (no iterations, or a script that went past them)
  const step = j.step || 0;
  return j.iterations && step <= j.iterations ? step / j.iterations : null;
}

function stepText(j) {
  // the step as `tidal jobs` shows it: "128/100000", or the step alone
  const step = j.step || 0;
  return j.iterations && step <= j.iterations ? `${step}/${j.iterations}` : String(step);
}

function pctText(p) {
  return p === null ? "" : `${(100 * p).toFixed(p > 0 && p < 0.001 ? 2 : p < 0.1 ? 1 : 0)}%`;
}

function stateBadges(j) {
  // the state as `tidal jobs` shows it; a job past the control plane's stall time-out is marked stalled
  const out = [el("span", { class: `badge ${j.state}${j.stalled_s ? " stalled" : ""}`, dataset: { role: "state" } }, j.state)];
  if (j.stalled_s) out.push(" ", el("span", { class: "badge stalled", dataset: { role: "stalled" }, title: j.reason || "" },
                                   `stalled ${relSpan(j.stalled_s)}`));
  return out;
}

function relSpan(s) {
  return s < 90 ? `${Math.round(s)} s` : s < 5400 ? `${Math.round(s / 60)} min` : `${(s / 3600).toFixed(1)} h`;
}

function deadlineText(j, now) {
  // a live job: its deadline from now; an ended one: whether it was met (no countdown)
  if (!j.deadline_at) return "–";
  if (!FINISHED.has(j.state)) return relTime(j.deadline_at, now);
  if (!j.end_time || j.state !== "completed") return clockTime(j.deadline_at);
  const by = j.end_time - j.deadline_at;
  return by <= 0 ? `${clockTime(j.deadline_at)} (met)` : `${clockTime(j.deadline_at)} (missed by ${relSpan(by)})`;
}

function finishText(j, now) {
  // an ended job: when it ended; a live one: when it is predicted to
  if (FINISHED.has(j.state)) return j.end_time ? `ended ${clockTime(j.end_time)} (${relTime(j.end_time, now)})` : "ended";
  return j.predicted_finish ? relTime(j.predicted_finish, now) : "–";
}

function rows(tbody, list, make) {
  tbody.replaceChildren(...list.map(make));
}

// -- cluster view ----------------------------------------------------------------------------------------------------
function renderCluster(s) {
  const nodes = s.nodes || [];
  const gpus = nodes.reduce((n, x) => n + x.gpus.length, 0);
  const busy = nodes.reduce((n, x) => n + x.gpus.filter((g) => g.job).length, 0);
  const byType = new Map();  // GPU type (the node's gpu-type label) -> GPUs of that type
  for (const n of nodes) {
    const t = (n.labels || {})["gpu-type"];
    if (t) byType.set(t, (byType.get(t) || 0) + n.gpus.length);
  }
  const types = byType.size ? ` (${[...byType].sort(([a], [b]) => a.localeCompare(b)).map(([t, k]) => `${k} ${t}`).join(", ")})` : "";
  $("cluster-summary").textContent = `${nodes.length} nodes, ${busy}/${gpus} GPUs busy${types}, policy ${s.policy}`;
  const seen = new Map();
  $("nodes").replaceChildren(...nodes.map((n) => {
    const cells = n.gpus.map((g) => {
      const own = g.job && g.job !== "busy";
      if (own) seen.set(g.job, true);
      const cell = el("span", { class: `gpu ${g.job ? (own ? "held" : "other") : "free"}`,
                                dataset: { gid: g.gid, job: g.job || "" },
                                title: `GPU ${g.gid} (${n.name}:${g.index}) — ${g.job ? (own ? g.job : "another tenant's job") : "free"}` },
                      String(g.index));
      if (own) cell.style.background = jobColor(g.job);
      if (own) cell.addEventListener("click", () => { location.hash = `#/job/${encodeURIComponent(g.job)}`; });
      return cell;
    });
    return el("div", { class: `node ${n.state}`, dataset: { node: n.name, state: n.state } },
              el("div", { class: "node-head" }, el("strong", {}, n.name),
                 el("span", { class: `badge ${n.state}` }, n.state === "up" ? "up" : n.state === "unreachable" ? "SILENT" : "DOWN"),
                 el("span", { class: "gpu-type", title: "GPUs of this node and their type" },
                    `${n.gpus.length} × ${(n.labels || {})["gpu-type"] || "GPU"}`),
                 el("span", { class: "muted" }, n.address || "")),
              el("div", { class: "gpus" }, ...cells));
  }));
  const jobs = new Map((s.jobs || []).map((j) => [j.id, j]));
  $("legend").replaceChildren(...[...seen.keys()].map((id) => {
    const sw = el("span", { class: "swatch" });
    sw.style.background = jobColor(id);
    const j = jobs.get(id);
    return el("a", { href: `#/job/${encodeURIComponent(id)}`, class: "legend-item" }, sw, id,
              j ? el("span", { class: "muted" }, ` ${j.gpus.length} GPU${j.gpus.length === 1 ? "" : "s"}, ${j.state}`) : null);
  }));
}

// -- jobs table --------------------------------------------------------------------------------------------------------
function sortValue(j, key) {
  if (key === "gpus_now") return j.gpus.length;
  if (key === "progress") return progressOf(j) ?? -Infinity;
  if (key === "predicted_finish" && FINISHED.has(j.state)) return j.end_time ?? -Infinity;
  const v = j[key];
  return v === null || v === undefined ? -Infinity : v;
}

function renderJobs(s) {
  const q = $("job-filter").value.trim().toLowerCase();
  const which = $("job-state-filter").value;
  let list = (s.jobs || []).filter((j) => {
    if (which === "live" && FINISHED.has(j.state)) return false;
    if (which === "finished" && !FINISHED.has(j.state)) return false;
    return !q || [j.id, j.name, j.user, j.state].some((x) => String(x).toLowerCase().includes(q));
  });
  const { key, dir } = state.sort;
  list = list.slice().sort((a, b) => {
    const x = sortValue(a, key), y = sortValue(b, key);
    return (x < y ? -1 : x > y ? 1 : 0) * dir;
  });
  for (const th of document.querySelectorAll("#jobs-table th")) {
    th.setAttribute("aria-sort", th.dataset.key === key ? (dir > 0 ? "ascending" : "descending") : "none");
  }
  $("jobs-empty").hidden = list.length > 0;
  rows($("jobs-table").tBodies[0], list, (j) => jobRow(j, s.time));
}

function progressCell(j) {
  const pct = progressOf(j);
  const bar = el("span", { class: "bar" }, el("span", { class: "fill" }));
  bar.firstChild.style.width = `${(100 * (pct ?? 0)).toFixed(1)}%`;
  return el("td", { class: "progress" }, bar, " ", el("span", { class: "step" }, stepText(j)),
            pct === null ? null : el("span", { class: "pct muted" }, ` ${pctText(pct)}`));
}

function jobRow(j, now) {
  const ended = FINISHED.has(j.state);
  const late = !ended && j.deadline_at && j.predicted_finish && j.predicted_finish > j.deadline_at;
  const missed = ended && j.state === "completed" && j.deadline_at && j.end_time > j.deadline_at;
  const tr = el("tr", { dataset: { job: j.id, state: j.state, stalled: j.stalled_s ? "1" : "" } },
    el("td", {}, el("a", { href: `#/job/${encodeURIComponent(j.id)}` }, j.id)),
    el("td", {}, j.user),
    el("td", { class: "state" }, ...stateBadges(j)),
    el("td", { class: "num" }, `${j.gpus.length} / ${j.min_gpus ?? "–"} / ${j.max_gpus ?? "–"}`),
    el("td", { class: "num" }, j.samples_per_s ? `${fmtNum(j.samples_per_s)} samples/s` : "–"),
    progressCell(j),
    el("td", { class: `deadline${missed ? " late" : ""}` }, deadlineText(j, now)),
    el("td", { class: `finish${late ? " late" : ""}` }, finishText(j, now)));
  return tr;
}

// -- job page -------------------------------------------------------------------------------------------------------------
function dl(box, pairs) {
  box.replaceChildren(...pairs.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
}

// a job's GPU-type constraint: "A100, V100", "not T4", "any"
function gpuTypesText(j) {
  const only = (j.gpu_types || []).join(", "), never = (j.exclude_gpu_types || []).join(", ");
  if (only && never) return `${only} (not ${never})`;
  return only || (never ? `not ${never}` : "any");
}

function renderJob(s) {
  if (s.job_error || (s.job && s.job.id !== state.route.id)) {
    $("job-error").hidden = !s.job_error;
    $("job-error").textContent = s.job_error || "";
    $("job-body").hidden = true;
    return;
  }
  const j = s.job;
  if (!j) return;
  $("job-error").hidden = true;
  $("job-body").hidden = false;
  $("job-title").textContent = j.id;
  $("job-state").replaceChildren(...stateBadges(j));
  renderActions(j);
  const pct = progressOf(j), ended = FINISHED.has(j.state);
  dl($("job-summary"), [
    ["Tenant", j.user], ["GPUs now / min / max", `${j.gpus.length} / ${j.min_gpus} / ${j.max_gpus}`],
    ["GPU types", gpuTypesText(j)],
    ["Pinned", j.pinned ?? "no"], ["Step", stepText(j) + (pct === null ? "" : ` (${pctText(pct)})`)],
    ["Throughput", j.samples_per_s ? `${fmtNum(j.samples_per_s)} samples/s (${fmtNum(j.steps_per_s)} steps/s)` : "–"],
    ["Deadline", !j.deadline_at ? "none" : ended ? deadlineText(j, s.time)
                                          : `${clockTime(j.deadline_at)} (${relTime(j.deadline_at, s.time)})`],
    ended ? ["Ended", j.end_time ? `${clockTime(j.end_time)} (${relTime(j.end_time, s.time)})` : "–"]
          : ["Predicted finish", j.predicted_finish ? `${clockTime(j.predicted_finish)} (${relTime(j.predicted_finish, s.time)})` : "–"],
    ["Rescales", j.timeline.changes.length], ["Exit", j.exit_info || j.drop_reason || "–"],
    ["Reason", j.reason || "–"],
  ]);
  renderSizing(j);
  renderAdmission(j, s.policy);
  renderTimeline(j, s.time);
  renderThroughput(j, s.time);
  rows($("procs-table").tBodies[0], j.processes || [], (p) => el("tr", {}, el("td", {}, p.name), el("td", {}, p.node),
    el("td", {}, p.gpu ?? "–"), el("td", {}, p.state), el("td", {}, p.pid || "–"), el("td", {}, p.exit_code ?? "–")));
  rows($("events-table").tBodies[0], (j.events || []).slice(-60).reverse(), (e) => {
    const { time, kind, ...rest } = e;
    const detail = Object.entries(rest).filter(([, v]) => v !== null && v !== undefined)
      .map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join(" ");
    return el("tr", {}, el("td", {}, clockTime(time)), el("td", {}, kind), el("td", { class: "detail" }, detail));
  });
  const logs = $("job-logs");
  const atBottom = logs.scrollTop + logs.clientHeight >= logs.scrollHeight - 4;
  logs.textContent = j.logs || "(no output yet)";
  if (atBottom) logs.scrollTop = logs.scrollHeight;
}

function renderActions(j) {
  const form = $("scale-form"), input = $("scale-gpus");
  form.hidden = !j.actions.scale;
  $("cancel-button").hidden = !j.actions.cancel;
  input.min = j.min_gpus || 1;
  if (j.max_gpus) input.max = j.max_gpus;
  // follows the job's size until the user types a number of their own
  if (!input.dataset.edited) input.value = j.gpus.length || j.min_gpus || 1;
}

async function act(path, body) {
  const id = state.route.id;
  const r = await fetch(`/v1/jobs/${encodeURIComponent(id)}/${path}`, {
    method: "POST", cache: "no-store",
    headers: { Authorization: `Bearer ${state.token}`, "Content-Type": "application/json" },
    body: body ? JSON.stringify(body) : undefined,
  });
  let detail = "";
  try { detail = (await r.json()).detail; } catch (e) { detail = ""; }
  if (Array.isArray(detail)) detail = detail.map((d) => d.msg).join("; ");
  $("action-result").textContent = r.ok ? (path === "scale" ? `pinned at ${body.gpus} GPUs` : "cancelling")
                                        : `refused (${r.status}): ${detail}`;
  if (r.ok) delete $("scale-gpus").dataset.edited;
  if (r.status === 401) showLogin("Your token is no longer valid.");
}

function mib(bytes) {
  return bytes ? `${Math.round(bytes / 1048576)} MiB per worker` : "none";
}

function renderSizing(j) {
  // an auto-sized job (no GPU count in its spec): what it measured, its plan and its memory limit
  const z = j.sizing;
  $("job-sizing-head").hidden = $("job-sizing").hidden = !z;
  if (!z) return;
  const pairs = [["Stage", z.stage === "planned" ? "planned" : z.stage === "sampling" ? "measuring sizes" : "not started"]];
  if (z.stage === "sampling") {
    pairs.push(["Measuring", `${z.target} GPU${z.target === 1 ? "" : "s"}` + (z.queue.length ? `, then ${z.queue.join(", ")}` : "")]);
  }
  if (z.measured.length) pairs.push(["Measured at", z.measured.map((n) => `${n} GPU${n === 1 ? "" : "s"}`).join(", ")]);
  if (z.plan) {
    pairs.push(["Plan", `${z.plan.gpus} GPUs (range ${z.plan.min}–${z.plan.max})`]);
    if (z.plan.reason) pairs.push(["Why", z.plan.reason]);
  }
  pairs.push(["Memory limit", mib(z.memory)]);
  dl($("job-sizing"), pairs);
}

function renderAdmission(j, policy) {
  const a = j.admission;
  const pairs = [["Decision", j.state === "dropped" ? "declined" : a.admitted ? "admitted" : "waiting for admission"],
                 ["Policy", policy]];
  if (a.drop_reason) pairs.push(["Why declined", a.drop_reason]);
  if (a.class) pairs.push(["Class", a.class]);
  if (a.share !== null && a.share !== undefined) pairs.push(["Minimum satisfactory share", `${a.share} GPUs`]);
  if (Array.isArray(a.plan) && a.plan.length) {
    pairs.push(["Guaranteed plan", a.plan.map((seg) => Array.isArray(seg) ? seg.map((x) => typeof x === "number" && x > 1e9 ? clockTime(x) : x).join(" ") : JSON.stringify(seg)).join("; ")]);
  }
  const other = Object.entries(a.tags || {}).filter(([k]) => !["ef_class", "ef_share", "ef_plan"].includes(k));
  for (const [k, v] of other) pairs.push([k, typeof v === "object" ? JSON.stringify(v) : String(v)]);
  dl($("job-admission"), pairs);
}

function renderTimeline(j, now) {
  const tl = j.timeline;
  const end = j.end_time || now;
  const bands = tl.changes.map((c) => ({ from: c.switched_at - c.pause_s, to: c.switched_at, cls: "pause",
                                         title: `${c.kind}: paused ${(1000 * c.pause_s).toFixed(0)} ms — ${c.reason}` }));
  const marks = tl.changes.map((c) => ({ t: c.switched_at, cls: `mark ${c.kind}`, title: `${c.kind} ${c.from_size}→${c.to_size}: ${c.reason}` }));
  timeChart($("timeline-chart"), [{ points: tl.sizes, step: true, cls: "line size", label: "GPUs held", extendTo: end }],
            bands, marks, { yLabel: "GPUs", yMin: 0, height: 150 });
  rows($("changes-table").tBodies[0], tl.changes.slice().reverse(), (c) => el("tr", { dataset: { kind: c.kind } },
    el("td", {}, clockTime(c.switched_at)), el("td", {}, c.kind), el("td", {}, `${c.from_size} → ${c.to_size}`),
    el("td", { class: "num" }, `${(1000 * c.pause_s).toFixed(0)} ms`), el("td", {}, c.reason)));
}

function renderThroughput(j, now) {
  const live = j.throughput.live.map(([t, v]) => [t, v]);
  const segs = j.throughput.segments.flatMap(([a, b, v]) => [[a, v], [b, v]]);
  timeChart($("throughput-chart"), [
    { points: segs, cls: "line avg", label: "average between rescales" },
    { points: live, cls: "line live", label: "latest step time, sampled" },
  ], [], [], { yMin: 0, height: 150, empty: "no step measured yet" });
}

// -- scheduler view -----------------------------------------------------------------------------------------------------
function renderScheduler(s) {
  const sc = s.scheduler || { decisions: [] };
  $("sched-summary").textContent = `policy ${s.policy}, ${s.rounds} rounds`;
  $("sched-note").textContent = sc.recorded ? (sc.decisions.length ? "" : "No decision yet.")
    : "This server does not record its scheduler's decisions.";
  const ds = sc.decisions.slice().reverse();
  timeChart($("latency-chart"), [{ points: ds.map((d) => [d.time, 1000 * d.latency_s]), cls: "line live",
                                   label: "decision latency (ms)" }], [], [],
            { yLabel: "ms", yMin: 0, height: 120, empty: "no decision recorded" });
  // identical consecutive rounds are one row: "×N" and the time span they cover
  rows($("decisions-table").tBodies[0], sc.rows || [], (d) => {
    const changes = Object.entries(d.changes).map(([id, [a, b]]) => `${id}: ${a}→${b}`);
    if (d.other_jobs) changes.push(`(+${d.other_jobs} other tenants' jobs)`);
    const when = d.count > 1 ? `${clockTime(d.first_time)}–${clockTime(d.time)}` : clockTime(d.time);
    const lat = d.count > 1 ? `${(1000 * d.latency_s).toFixed(2)} ms (max ${(1000 * d.latency_max_s).toFixed(2)})`
                            : `${(1000 * d.latency_s).toFixed(2)} ms`;
    return el("tr", { dataset: { count: d.count } }, el("td", {}, when),
      el("td", { class: "num count" }, d.count > 1 ? `×${d.count}` : ""), el("td", { class: "num" }, lat),
      el("td", { class: "num" }, d.jobs), el("td", {}, d.admit.join(", ") || "–"),
      el("td", {}, Object.entries(d.drop).map(([id, why]) => `${id}: ${why}`).join("; ") || "–"),
      el("td", {}, changes.join(", ") || "–"));
  });
}

// -- wiring ---------------------------------------------------------------------------------------------------------------
function wire() {
  $("login-form").addEventListener("submit", (e) => {
    e.preventDefault();
    login($("token").value.trim());
  });
  $("logout").addEventListener("click", () => showLogin(""));
  window.addEventListener("hashchange", route);
  $("job-filter").addEventListener("input", render);
  $("scale-gpus").addEventListener("input", () => { $("scale-gpus").dataset.edited = "1"; });
  $("job-state-filter").addEventListener("change", render);
  for (const th of document.querySelectorAll("#jobs-table th")) {
    th.addEventListener("click", () => {
      const k = th.dataset.key;
      state.sort = { key: k, dir: state.sort.key === k ? -state.sort.dir : 1 };
      render();
    });
  }
  $("scale-form").addEventListener("submit", (e) => {
    e.preventDefault();
    act("scale", { gpus: parseInt($("scale-gpus").value, 10) });
  });
  $("cancel-button").addEventListener("click", () => {
    if (confirm(`Cancel job ${state.route.id}?`)) act("cancel");
  });
  const saved = sessionStorage.getItem(TOKEN_KEY);
  if (saved) login(saved);
  else showLogin("");
}

wire();
})();
