// roll view: the rollout records of one run (or two, compared), in plain JavaScript.
// Data: /api/* of `roll view` (polled, so a running run's steps appear), or the JSON inlined
// by `roll view --export` (the script element #roll-data). docs/view.md describes the page.
"use strict";

const EMBED = (() => {
  const node = document.getElementById("roll-data");
  return node ? JSON.parse(node.textContent) : null;
})();

const state = {
  runs: [], run: 0, step: null, rows: [], row: null, follow: true,
  metric: null, overlay: "gap", prompts: {},
};

async function getJSON(path) {
  const response = await fetch(path, { cache: "no-store" });
  if (!response.ok) throw new Error(`${path}: ${await response.text()}`);
  return response.json();
}

const api = {
  runs: () => (EMBED ? Promise.resolve(EMBED) : getJSON("/api/runs")),
  step: (run, step) =>
    EMBED ? Promise.resolve(embeddedStep(run, step)) : getJSON(`/api/step?run=${run}&step=${step}`),
  prompts: (run) => (EMBED ? Promise.resolve(embeddedPrompts(run)) : getJSON(`/api/prompts?run=${run}`)),
};

// an exported page holds each step in its own JSON script element (data-run,
// data-step), parsed the first time the step is shown
const parsed = new Map();
function embeddedStep(run, step) {
  const key = `${run}/${step}`;
  if (!parsed.has(key)) {
    const node = document.querySelector(`script[data-run="${run}"][data-step="${step}"]`);
    parsed.set(key, JSON.parse(node.textContent));
  }
  return parsed.get(key);
}

function embeddedPrompts(run) {
  const index = {};
  for (const { step } of EMBED.runs[run].steps) {
    embeddedStep(run, step).rows.forEach((row, k) => (index[row.prompt_key] ||= []).push([step, k]));
  }
  return index;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child));
  return node;
}

const $ = (id) => document.getElementById(id);
const fmt = (v) => (v === null || v === undefined ? "n/a" : String(v));
const round5 = (x) => Math.round(x * 1e5) / 1e5;
const currentRun = () => state.runs[state.run];

// ---- timeline --------------------------------------------------------------------------------
function metricKeys(run) {
  const keys = new Set();
  for (const record of run.metrics) {
    for (const [k, v] of Object.entries(record)) if (typeof v === "number" && k !== "step" && k !== "time") keys.add(k);
  }
  return [...keys].sort();
}

function renderMetricSelect() {
  const keys = metricKeys(currentRun());
  const select = $("metric");
  if (!state.metric || !keys.includes(state.metric)) {
    state.metric = ["rollout/reward_mean", "rollout/success_rate"].find((k) => keys.includes(k)) || keys[0] || null;
  }
  select.replaceChildren(...keys.map((k) => el("option", { value: k }, k)));
  if (state.metric) select.value = state.metric;
}

function renderTimeline() {
  const svg = $("timeline");
  const width = svg.clientWidth || 800, height = 140, pad = 28;
  const colours = ["#36c", "#2a2"];
  const series = state.runs.map((run) =>
    run.metrics.filter((r) => typeof r[state.metric] === "number").map((r) => [r.step, r[state.metric]]));
  const recorded = currentRun().steps.map((s) => s.step);
  const all = series.flat();
  const xs = [...all.map((p) => p[0]), ...recorded, 0];
  const ys = all.map((p) => p[1]);
  const [x0, x1] = [Math.min(...xs), Math.max(...xs, 1)];
  const [y0, y1] = ys.length ? [Math.min(...ys), Math.max(...ys)] : [0, 1];
  const X = (x) => pad + ((x - x0) / (x1 - x0 || 1)) * (width - 2 * pad);
  const Y = (y) => height - pad / 2 - ((y - y0) / (y1 - y0 || 1)) * (height - pad);
  const ns = "http://www.w3.org/2000/svg";
  const make = (tag, attrs) => {
    const node = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    return node;
  };
  svg.replaceChildren();
  series.forEach((points, i) => {
    if (points.length) svg.append(make("polyline", { class: "line", stroke: colours[i], points: points.map(([x, y]) => `${X(x)},${Y(y)}`).join(" ") }));
  });
  const values = new Map(series[state.run].map(([x, y]) => [x, y]));
  for (const step of recorded) {
    const y = values.has(step) ? Y(values.get(step)) : height - pad / 2;
    const dot = make("circle", { class: "rec" + (step === state.step ? " sel" : ""), cx: X(step), cy: y, r: 4 });
    dot.append(make("title", {}));
    dot.firstChild.textContent = `step ${step}: ${state.metric} = ${fmt(values.get(step))}`;
    dot.addEventListener("click", () => selectStep(step, false));
    svg.append(dot);
  }
  const label = (x, y, text) => { const t = make("text", { x, y }); t.textContent = text; svg.append(t); };
  label(2, 12, fmt(round5(y1)));
  label(2, height - 4, fmt(round5(y0)));
  label(width - pad - 30, height - 4, `step ${x1}`);
  $("timeline-note").textContent = state.runs.length > 1 ? `blue: ${state.runs[0].id}, green: ${state.runs[1].id}` : "";
}

function renderSteps() {
  const buttons = currentRun().steps.map((s) => {
    const sm = s.summary;
    const title = `${sm.rows} rows in ${sm.groups} groups, reward mean ${fmt(round5(sm.reward_mean))}, ` +
      `finish ${JSON.stringify(sm.finish_reasons)}, max staleness ${sm.max_staleness}`;
    return el("button", { class: s.step === state.step ? "sel" : "", title, "data-step": s.step, onclick: () => selectStep(s.step, false) }, s.step);
  });
  $("steps").replaceChildren(...buttons);
}

// ---- a step's groups -------------------------------------------------------------------------
async function selectStep(step, follow) {
  state.step = step;
  state.follow = follow;
  const data = await api.step(state.run, step);
  state.rows = data.rows;
  state.row = null;
  $("sample-panel").hidden = true;
  fillFilterOptions();
  renderTimeline();
  renderSteps();
  renderGroups();
}

function fillFilterOptions() {
  for (const [id, key] of [["f-finish", "finish_reason"], ["f-env", "env"]]) {
    const select = $(id), keep = select.value;
    const values = [...new Set(state.rows.map((r) => r[key]))].sort();
    select.replaceChildren(el("option", { value: "" }, "any"), ...values.map((v) => el("option", { value: v }, v || "(none)")));
    select.value = values.includes(keep) ? keep : "";
  }
}

function passes(row) {
  const num = (id) => ($(id).value === "" ? null : Number($(id).value));
  const [lo, hi, stale] = [num("f-reward-min"), num("f-reward-max"), num("f-stale")];
  return (lo === null || row.reward >= lo) && (hi === null || row.reward <= hi) &&
    (stale === null || row.staleness <= stale) &&
    (!$("f-finish").value || row.finish_reason === $("f-finish").value) &&
    (!$("f-env").value || row.env === $("f-env").value);
}

function renderGroups() {
  const run = currentRun();
  $("step-title").textContent = `${run.id} · step ${state.step} · ${state.rows.length} recorded rows`;
  const byGroup = new Map();
  state.rows.forEach((row, k) => {
    if (!byGroup.has(row.group)) byGroup.set(row.group, []);
    byGroup.get(row.group).push([row, k]);
  });
  let shown = 0;
  const columns = [];
  for (const [group, members] of byGroup) {
    const visible = members.filter(([row]) => passes(row));
    shown += visible.length;
    if (!visible.length) continue;
    const rewards = members.map(([row]) => row.reward);
    const mean = rewards.reduce((a, b) => a + b, 0) / rewards.length;
    const first = members[0][0];
    columns.push(el("div", { class: "group", "data-group": group },
      el("div", { class: "stats" }, `group ${group} · ${first.env || ""} · mean reward ${fmt(round5(mean))}`),
      el("div", { class: "stats rewards" }, `rewards: ${rewards.map(fmt).join(", ")}`),
      el("div", { class: "prompt" }, first.episode ? `${first.episode.tag} seed ${first.episode.seed}` : first.prompt),
      ...visible.map(([row, k]) => card(row, k))));
  }
  $("groups").replaceChildren(...columns);
  $("filter-count").textContent = `${shown} of ${state.rows.length} rows shown`;
}

function card(row, k) {
  return el("div", { class: "card" + (state.row === k ? " sel" : ""), id: `card-${k}`, "data-row": k, onclick: () => selectRow(k) },
    el("span", { class: "reward" }, `reward ${fmt(row.reward)}`),
    ` · ${row.finish_reason} · ${row.length} tokens · v${row.policy_version}` + (row.staleness ? ` (stale ${row.staleness})` : ""),
    el("div", { class: "resp" }, row.response));
}

// ---- one sample ------------------------------------------------------------------------------
const OVERLAYS = {
  gap: { name: "log-prob gap", values: (r) => (r.trainer_lp && r.behaviour_lp ? r.trainer_lp.map((t, j) => round5(t - r.behaviour_lp[j])) : null), diverging: true },
  entropy: { name: "entropy", values: (r) => r.entropy, diverging: false },
  advantage: { name: "advantage", values: (r) => r.advantage, diverging: true },
  mask: { name: "loss mask", values: (r) => r.mask, diverging: false },
  is_weight: { name: "correction weight", values: (r) => r.is_weight, diverging: true, centre: 1 },
  behaviour_lp: { name: "sampler log-prob", values: (r) => r.behaviour_lp, diverging: false },
  value: { name: "critic value", values: (r) => r.value, diverging: true },
};

function colour(kind, v, scale) {
  if (v === null || v === undefined) return "";
  if (kind === "mask") return v > 0 ? "rgba(60,170,60,.25)" : "rgba(220,60,60,.35)";
  const o = OVERLAYS[kind];
  const x = v - (o.centre || 0);
  const a = Math.min(1, Math.abs(x) / (scale || 1)) * 0.75;
  if (kind === "behaviour_lp") return `rgba(220,60,60,${a})`;
  if (kind === "entropy") return `rgba(140,60,200,${a})`;
  return x >= 0 ? `rgba(50,100,220,${a})` : `rgba(220,60,60,${a})`;
}

function selectRow(k) {
  state.row = k;
  renderGroups();
  renderSample();
}

function renderSample() {
  const row = state.rows[state.row];
  $("sample-panel").hidden = false;
  $("sample-title").textContent = `row ${row.row} · group ${row.group} · reward ${fmt(row.reward)}`;
  const parts = Object.entries(row.reward_parts || {}).map(([k, v]) => `${k}=${JSON.stringify(v)}`).join(", ");
  $("sample-meta").textContent = `finish ${row.finish_reason} · policy version ${row.policy_version} · staleness ${row.staleness} · ` +
    `env ${row.env || "-"} · ${row.length} generated tokens · reward parts: ${parts || "-"}`;
  renderTokens(row);
  renderEpisode(row);
  renderCompare(row);
}

function renderTokens(row) {
  const kind = state.overlay, overlay = OVERLAYS[kind];
  const values = overlay.values(row);
  // the scale: the largest distance from the centre over the generated tokens (an agent's
  // trace also holds context tokens, whose sampler log-prob is no sample)
  const spread = values ? values.filter((v, j) => row.generated[j] === 1 && v !== null) : [];
  const scale = Math.max(1e-9, ...spread.map((v) => Math.abs(v - (overlay.centre || 0))));
  $("overlay-note").textContent = values ? `colour scale ±${fmt(round5(scale))}` :
    kind === "entropy" ? "not recorded: this backend (megatron) computes only its mean (metric actor/entropy)" :
    kind === "is_weight" ? "not recorded: no rollout correction weights this step" :
    kind === "value" ? "not recorded: no critic in this run (PPO has one)" : "not recorded for this row";
  const spans = row.tokens.map((text, i) => {
    const j = i - row.start;
    const generated = j >= 0 && row.generated[j] === 1;
    const v = j >= 0 && values ? values[j] : null;
    const cls = "tok" + (generated ? "" : " ctx") + (generated && row.mask && row.mask[j] === 0 ? " rejected" : "");
    const span = el("span", { class: cls, "data-i": i }, text);
    if (generated) {
      span.title = `${overlay.name}: ${fmt(v)}`;
      span.dataset.value = fmt(v);
      span.style.background = colour(kind, v, scale);
    }
    span.addEventListener("mouseover", () => hover(row, i));
    return span;
  });
  $("tokens").replaceChildren(...spans);
}

function hover(row, i) {
  const j = i - row.start;
  const at = (a) => (a && j >= 0 ? a[j] : null);
  const values = OVERLAYS[state.overlay].values(row);
  $("hover").textContent = `token ${i} ${JSON.stringify(row.tokens[i])} (id ${row.ids[i]}) · ` +
    `${OVERLAYS[state.overlay].name}: ${fmt(at(values))} · sampler lp ${fmt(at(row.behaviour_lp))} · ` +
    `trainer lp ${fmt(at(row.trainer_lp))} · advantage ${fmt(at(row.advantage))} · mask ${fmt(at(row.mask))} · ` +
    `weight ${fmt(at(row.is_weight))} · generated ${fmt(at(row.generated))}`;
}

function renderEpisode(row) {
  const box = $("episode");
  if (!row.episode) { box.replaceChildren(); return; }
  const e = row.episode;
  const conversation = (row.conversation || []).map((span) =>
    el("div", { class: `turn ${span.role}` },
      el("span", { class: "who" }, span.role === "model" ? "policy (generated: actions, tool calls)" : "context (prompt, observations, tool results)"),
      span.text));
  const turns = el("table", {}, el("tr", {}, ...["turn", "action", "reward", "valid", "finish", "version", "segment"].map((h) => el("th", {}, h))),
    ...e.turns.map((t, k) => el("tr", {}, ...[k, t.action, t.reward, t.valid, t.finish_reason, t.policy_version, t.segment].map((v) => el("td", {}, fmt(v))))));
  box.replaceChildren(
    el("h2", {}, `episode: ${e.tag} seed ${e.seed} · ${e.status}${e.success ? " · success" : ""} · return ${fmt(e.return)} · part ${e.part + 1} of ${e.parts}`),
    ...(e.error ? [el("div", { class: "meta" }, `error: ${e.error}`)] : []),
    el("div", { class: "conversation" }, ...conversation), turns);
}

async function renderCompare(row) {
  const box = $("compare");
  if (state.runs.length < 2) { box.replaceChildren(); return; }
  const other = 1 - state.run;
  state.prompts[other] ||= await api.prompts(other);
  const hits = state.prompts[other][row.prompt_key] || [];
  const items = await Promise.all(hits.slice(0, 24).map(async ([step, k]) => [step, k, (await api.step(other, step)).rows[k]]));
  box.replaceChildren(
    el("h2", {}, `same prompt in ${state.runs[other].id}: ${hits.length} rows`),
    el("table", {}, el("tr", {}, el("th", {}, "step"), el("th", {}, "reward"), el("th", {}, "finish"), el("th", {}, "response")),
      ...items.map(([step, k, r]) => el("tr", { class: "compare-row", onclick: () => jump(other, step, k) },
        el("td", {}, step), el("td", {}, fmt(r.reward)), el("td", {}, r.finish_reason), el("td", {}, r.response)))));
}

async function jump(run, step, k) {
  state.run = run;
  $("run-select").value = String(run);
  renderMetricSelect();
  await selectStep(step, false);
  selectRow(k);
}

// ---- start and refresh -----------------------------------------------------------------------
function renderHeader() {
  const title = $("runs-title");
  if (state.runs.length < 2) { title.textContent = state.runs[0].id; return; }
  if ($("run-select")) return;
  const select = el("select", { id: "run-select" }, ...state.runs.map((r, i) => el("option", { value: i }, r.id)));
  select.addEventListener("change", async () => {
    state.run = Number(select.value);
    renderMetricSelect();
    const steps = currentRun().steps;
    if (steps.length) await selectStep(steps[steps.length - 1].step, true);
  });
  title.replaceChildren("run ", select, ` compared with the other (${state.runs.map((r) => r.id).join(" vs ")})`);
}

async function refresh() {
  const data = await api.runs();
  const before = currentRun() ? currentRun().steps.length : -1;
  const logged = currentRun() ? currentRun().metrics.length : -1;
  state.runs = data.runs;
  const run = currentRun();
  $("live").textContent = EMBED ? "exported snapshot" : `status ${run.status} · refreshed ${new Date().toLocaleTimeString()}`;
  if (run.steps.length !== before) {
    renderMetricSelect();
    const last = run.steps.length ? run.steps[run.steps.length - 1].step : null;
    if (last !== null && (state.step === null || state.follow)) await selectStep(last, true);
    else { renderTimeline(); renderSteps(); }
  } else if (run.metrics.length !== logged) {
    renderMetricSelect();
    renderTimeline();  // new metrics, no new record (e.g. the records' budget is spent)
  }
}

function wire() {
  $("metric").addEventListener("change", (e) => { state.metric = e.target.value; renderTimeline(); });
  $("overlay").addEventListener("change", (e) => { state.overlay = e.target.value; if (state.row !== null) renderTokens(state.rows[state.row]); });
  for (const id of ["f-reward-min", "f-reward-max", "f-finish", "f-stale", "f-env"]) $(id).addEventListener("input", renderGroups);
  window.addEventListener("resize", renderTimeline);
}

async function main() {
  wire();
  await refresh();
  renderHeader();
  document.body.dataset.ready = "1";  // the browser test waits for this
  if (!EMBED) setInterval(() => refresh().catch((err) => ($("live").textContent = String(err))), 3000);
}

main().catch((err) => { document.body.prepend(el("pre", { class: "error" }, String(err.stack || err))); });
