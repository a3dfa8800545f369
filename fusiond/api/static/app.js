// fusion dashboard: vanilla JavaScript, no libraries, nothing fetched but this daemon's API.
// The session token comes in the URL's fragment (#token=...), from `fusionctl dashboard`; it is
// kept in sessionStorage (this origin only) and sent as a bearer token, never as a cookie.
"use strict";

const TOKEN_KEY = "fusion-dashboard-token";
const points = new Map();   // job id -> [{step, loss, held_out_loss, ...}]
let lastSnapshot = null;

function takeToken() {
  const m = /(?:^|[#&])token=([A-Za-z0-9_\-]+)/.exec(location.hash);
  if (m) {
    sessionStorage.setItem(TOKEN_KEY, m[1]);
    history.replaceState(null, "", location.pathname + location.search);
  }
  return sessionStorage.getItem(TOKEN_KEY);
}

// -- small DOM helpers (text only: nothing from the daemon is parsed as HTML) ----------------

function h(tag, attrs, ...kids) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "text") el.textContent = v;
    else if (k === "style") {  // through the CSSOM: the page's CSP forbids style attributes
      for (const decl of String(v).split(";")) {
        const i = decl.indexOf(":");
        if (i > 0) el.style.setProperty(decl.slice(0, i).trim(), decl.slice(i + 1).trim());
      }
    }
    else el.setAttribute(k, v);
  }
  for (const kid of kids.flat()) {
    if (kid === null || kid === undefined || kid === false) continue;
    el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return el;
}

const SVG = "http://www.w3.org/2000/svg";
function s(tag, attrs) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  return el;
}

function fmtRate(bits) {
  if (bits === null || bits === undefined) return "–";
  for (const [d, p] of [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]]) {
    if (Math.abs(bits) >= d) return `${(bits / d).toPrecision(3)} ${p}bit/s`;
  }
  return `${bits.toFixed(0)} bit/s`;
}
function fmtS(x) {
  if (x === null || x === undefined || !isFinite(x)) return "–";
  if (x < 1e-3) return `${(x * 1e6).toFixed(0)} µs`;
  if (x < 1) return `${(x * 1e3).toPrecision(3)} ms`;
  if (x < 120) return `${x.toPrecision(3)} s`;
  if (x < 7200) return `${(x / 60).toFixed(1)} min`;
  return `${(x / 3600).toFixed(1)} h`;
}
function fmtAge(x) { return x === null || x === undefined ? "age ?" : `${fmtS(x)} ago`; }
function fmtNum(x, digits = 4) {
  return x === null || x === undefined || !isFinite(x) ? "–" : Number(x).toPrecision(digits);
}
function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  for (const [d, p] of [[2 ** 30, "GiB"], [2 ** 20, "MiB"], [2 ** 10, "KiB"]]) {
    if (n >= d) return `${(n / d).toFixed(1)} ${p}`;
  }
  return `${n} B`;
}
let names = new Map();  // node id -> name, from the last snapshot's members
function named(text) {  // node ids in a sentence of the planner's, as names
  return String(text).replace(/\bn[0-9a-f]{20}\b/g, (id) => names.get(id) || short(id));
}
function short(id) { return id ? String(id).slice(0, 8) + "…" : "–"; }
function who(m) { return m && m.name ? m.name : short(m && m.node_id); }
function figure(label, value, cls) {
  return h("div", {class: `figure ${cls || ""}`},
           h("span", {class: "label", text: label}), h("span", {class: "value", text: value}));
}

// -- the cluster ----------------------------------------------------------------------------

function renderCluster(cl) {
  const node = cl.node || {};
  document.getElementById("node").textContent =
    `${node.name || ""} ${short(node.node_id)} · ${node.phase || ""} · ${node.security || ""} links`;
  const notice = document.getElementById("notice");
  const problems = [cl.hint, cl.warning].filter(Boolean);
  if (cl.has_quorum === false) {
    problems.unshift(`NO QUORUM: ${cl.alive_voters} of ${cl.voters} voters alive, ` +
                     `${cl.needed} needed: there is no working scheduler`);
  }
  notice.hidden = problems.length === 0;
  notice.textContent = problems.join("\n");
  const leader = cl.members.find((m) => m.node_id === cl.leader);
  const q = document.getElementById("quorum");
  q.replaceChildren(
    figure("cluster", short(node.cluster_id)),
    figure("scheduler", leader ? who(leader) : (cl.leader ? short(cl.leader) : "none"),
           cl.leader ? "" : "bad"),
    figure("term", cl.term ?? "–"),
    figure("quorum", cl.has_quorum === null ? "–" :
           `${cl.has_quorum ? "yes" : "NO"} (${cl.alive_voters} of ${cl.voters}, ` +
           `${cl.needed} needed)`, cl.has_quorum === false ? "bad" : "ok"),
    figure("members", String(cl.members.length)));
  const rows = cl.members.map((m) => h("tr", {
      class: `member state-${m.state}`, "data-node": m.node_id, "data-state": m.state},
    h("td", {}, m.name || "–", m.self ? h("span", {class: "muted small", text: " (this node)"}) : null),
    h("td", {class: "mono", text: short(m.node_id), title: m.node_id}),
    h("td", {}, h("span", {class: "badge state", text: m.state})),
    h("td", {}, h("span", {class: `badge role-${m.role}`, text: m.role})),
    h("td", {class: "mono", text: m.address || "–"}),
    h("td", {class: "num", text: m.self ? "" : fmtS(m.rtt_s)}),
    h("td", {class: "num", text: m.self ? "" : fmtRate(m.bandwidth_bits_per_s)}),
    h("td", {text: m.device || "–"})));
  document.querySelector("#members tbody").replaceChildren(...rows);
}

// -- the link matrix ------------------------------------------------------------------------

function heatColor(bits, lo, hi) {
  if (!(bits > 0)) return null;
  const t = hi > lo ? (Math.log10(bits) - lo) / (hi - lo) : 1;
  const hue = Math.max(0, Math.min(1, t)) * 120;  // red (slowest) .. green (fastest)
  return `hsl(${hue.toFixed(0)}, 60%, 55%)`;
}

function renderLinks(links, members) {
  const byId = new Map(members.map((m) => [m.node_id, m]));
  const ids = links.ids;
  const vals = [];
  for (const row of Object.values(links.cells)) {
    for (const c of Object.values(row)) {
      if (c.bandwidth_bits_per_s > 0 && !c.stale) vals.push(Math.log10(c.bandwidth_bits_per_s));
    }
  }
  const lo = vals.length ? Math.min(...vals) : 0, hi = vals.length ? Math.max(...vals) : 1;
  const head = h("tr", {}, h("th", {text: "from \\ to"}),
                 ids.map((id) => h("th", {text: who(byId.get(id)), title: id})));
  const body = ids.map((src) => h("tr", {},
    h("th", {text: who(byId.get(src)), title: src}),
    ids.map((dst) => {
      if (src === dst) return h("td", {class: "self", text: "·"});
      const c = (links.cells[src] || {})[dst];
      if (!c) return h("td", {class: "none", text: "not measured"});
      const color = c.stale ? null : heatColor(c.bandwidth_bits_per_s, lo, hi);
      return h("td", {class: `cell${c.stale ? " stale" : ""}`, "data-src": src, "data-dst": dst,
                      style: color ? `background:${color}` : null,
                      title: `${who(byId.get(src))} → ${who(byId.get(dst))}` +
                             (c.spread !== null && c.spread !== undefined ?
                              `, ±${(c.spread * 100).toFixed(0)} % spread` : "")},
        h("div", {class: "bw", text: c.bandwidth_bits_per_s > 0 ?
                  fmtRate(c.bandwidth_bits_per_s) : "RTT only"}),
        h("div", {text: fmtS(c.rtt_s)}),
        h("div", {class: "age", text: c.stale ? `stale · ${fmtAge(c.age_s)}` : fmtAge(c.age_s)}));
    })));
  const table = h("table", {class: "heat"}, h("thead", {}, head), h("tbody", {}, body));
  const legend = h("div", {class: "legend muted small"},
    h("span", {text: vals.length ? fmtRate(10 ** lo) : ""}), h("span", {class: "bar"}),
    h("span", {text: vals.length ? fmtRate(10 ** hi) : ""}),
    h("span", {text: `· hatched: stale (a member not alive, or older than ` +
                     `${fmtS(links.stale_after_s)})`}));
  document.getElementById("links").replaceChildren(
    ids.length ? table : h("p", {class: "muted", text: "no members yet"}), legend);
}

// -- jobs -----------------------------------------------------------------------------------

function lossChart(job, pts) {
  const W = 600, H = 220, L = 48, R = 10, T = 10, B = 24;
  const svg = s("svg", {class: "chart", viewBox: `0 0 ${W} ${H}`, id: `loss-${job.job_id}`,
                        "data-points": String(pts.length), preserveAspectRatio: "none"});
  const series = [["train", pts.filter((p) => p.loss !== undefined)
                                   .map((p) => [p.step, p.loss])],
                  ["held-out", pts.filter((p) => p.held_out_loss !== undefined)
                                      .map((p) => [p.step, p.held_out_loss])]];
  const all = series.flatMap(([, xs]) => xs);
  svg.append(s("line", {class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B}),
             s("line", {class: "axis", x1: L, y1: T, x2: L, y2: H - B}));
  if (!all.length) {
    const t = s("text", {x: W / 2, y: H / 2, "text-anchor": "middle"});
    t.textContent = "no steps yet";
    svg.append(t);
    return svg;
  }
  const x0 = Math.min(...all.map((p) => p[0])), x1 = Math.max(x0 + 1, ...all.map((p) => p[0]));
  let y0 = Math.min(...all.map((p) => p[1])), y1 = Math.max(...all.map((p) => p[1]));
  if (y1 - y0 < 1e-9) { y0 -= 0.5; y1 += 0.5; }
  const X = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
  const Y = (y) => T + (y1 - y) / (y1 - y0) * (H - T - B);
  for (const [v, anchor] of [[y1, T + 4], [y0, H - B]]) {
    const t = s("text", {x: L - 4, y: anchor, "text-anchor": "end"});
    t.textContent = fmtNum(v, 3);
    svg.append(t);
  }
  for (const [v, a] of [[x0, "start"], [x1, "end"]]) {
    const t = s("text", {x: X(v), y: H - 6, "text-anchor": a});
    t.textContent = `step ${v + 1}`;
    svg.append(t);
  }
  for (const [cls, xs] of series) {
    if (!xs.length) continue;
    svg.append(s("polyline", {class: cls, "data-points": String(xs.length),
      points: xs.map(([x, y]) => `${X(x).toFixed(1)},${Y(y).toFixed(1)}`).join(" ")}));
  }
  return svg;
}

function codec(e) {
  if (e.encoding === "int8") return "int8";
  if (e.density !== null && e.density !== undefined && e.density < 1) {
    return `top-k ${Number(e.density).toPrecision(2)}`;
  }
  return "exact";
}

function stagesTable(job) {
  const rows = (job.stages || []).map((st) => h("tr", {"data-stage": st.stage},
    h("td", {class: "num", text: st.stage}),
    h("td", {}, who(st.machine), (st.replicas || []).length ?
      h("span", {class: "muted small", text: ` + ${st.replicas.map(who).join(", ")}`}) : null),
    h("td", {class: "mono small ops", text: st.first_op ?
             `${st.ops} ops: ${st.first_op} … ${st.last_op}` : "–"}),
    h("td", {class: "num", text: st.predicted_compute_s !== undefined ?
             fmtS(st.predicted_compute_s) : "–"},
      st.recompute ? h("span", {class: "badge recompute", text: "recompute",
                                title: "keeps only its inputs and runs its forward again in " +
                                       "the backward: its activations would not fit kept"})
                   : null,
      st.checkpoint ? h("span", {class: "badge recompute", text: `checkpoint ${st.checkpoint}`,
                                 title: "recomputes these of its blocks in the backward, " +
                                        "keeping only their inputs: the cheapest that fits"})
                    : null,
      st.offload ? h("span", {class: "badge recompute", text: "offload",
                              title: "keeps its optimizer state on disk, read and written " +
                                     "once per step: it would not fit in memory"})
                 : null,
      st.offload_params ? h("span", {class: "badge recompute", text: "weights on disk",
                                     title: "keeps its weights and gradients on disk too, " +
                                            "a few blocks in memory at a time"})
                        : null),
    h("td", {}, h("div", {class: "share", title:
        `busy ${fmtNum((st.busy || 0) * 100, 3)} %, waiting ${fmtNum((st.wait || 0) * 100, 3)} %`},
      h("div", {class: "busy", style: `width:${((st.busy || 0) * 100).toFixed(1)}%`}),
      h("div", {class: "wait", style: `width:${((st.wait || 0) * 100).toFixed(1)}%`}))),
    h("td", {class: "num", text: st.busy === null || st.busy === undefined ? "–" :
             `${(st.busy * 100).toFixed(0)} / ${((st.wait || 0) * 100).toFixed(0)} %`})));
  return h("table", {class: "grid stages"},
    h("thead", {}, h("tr", {}, ["stage", "machines", "ops", "predicted", "busy / waiting", ""]
      .map((t) => h("th", {text: t})))), h("tbody", {}, rows));
}

function edgesTable(job) {
  if (!(job.edges || []).length) return h("p", {class: "muted small", text: "no cut edges"});
  const rows = job.edges.map((e) => {
    const wire = Object.values(e.wire_bytes || {}).reduce((a, b) => a + b, 0);
    const dense = Object.values(e.dense_bytes || {}).reduce((a, b) => a + b, 0);
    return h("tr", {"data-edge": e.edge},
      h("td", {class: "mono small", text: e.edge}),
      h("td", {text: `${e.src} → ${e.dst}`}),
      h("td", {text: codec(e)}),
      h("td", {class: "num", text: fmtBytes(wire)}),
      h("td", {class: "num", text: fmtBytes(dense)}));
  });
  return h("table", {class: "grid edges"},
    h("thead", {}, h("tr", {}, ["cut edge", "stages", "codec", "on the wire", "dense"]
      .map((t) => h("th", {text: t})))), h("tbody", {}, rows));
}

function renderJob(job) {
  let pts = points.get(job.job_id) || [];
  if (job.reset) pts = job.points.slice();
  else pts = pts.concat(job.points);
  if (pts.length > 5000) pts = pts.slice(pts.length - 5000);
  points.set(job.job_id, pts);
  const pct = job.steps ? Math.min(100, (job.step || 0) / job.steps * 100) : 0;
  const rate = job.tokens_per_s ? `${fmtNum(job.tokens_per_s, 3)} tokens/s` :
               job.samples_per_s ? `${fmtNum(job.samples_per_s, 3)} samples/s` : "–";
  const slower = job.predicted_iteration_s && job.measured_iteration_s ?
                 job.measured_iteration_s / job.predicted_iteration_s : null;
  const figs = h("div", {class: "figures"},
    figure("loss", job.first_loss !== null && job.first_loss !== undefined ?
           `${fmtNum(job.first_loss)} → ${fmtNum(job.loss)}` : fmtNum(job.loss)),
    figure("throughput", rate),
    figure("iteration: predicted / measured",
           `${fmtS(job.predicted_iteration_s)} / ${fmtS(job.measured_iteration_s)}` +
           (slower ? ` (${slower.toFixed(2)}x)` : "")),
    figure("restarts", job.restarts ?? 0, job.restarts ? "bad" : ""),
    figure("checkpoint", job.checkpoint_step === null || job.checkpoint_step === undefined ?
           "none" : `after step ${job.checkpoint_step + 1}, ${fmtAge(job.checkpoint_age_s)}`),
    figure("ETA", job.state === "running" ? fmtS(job.eta_s) : "–"),
    figure("scheduler", who(job.scheduler)),
    figure("plan", job.method ? `${job.method}${job.bottleneck ? ", bottleneck " +
           named(job.bottleneck) : ""}` : "even cut (--stages)"));
  const hasHeld = pts.some((p) => p.held_out_loss !== undefined);
  const card = h("div", {class: `job job-${job.state}`, id: `job-${job.job_id}`,
                         "data-job": job.job_id, "data-state": job.state},
    h("div", {class: "job-head"},
      h("h3", {text: job.name || job.job_id}),
      h("span", {class: "mono muted small", text: job.job_id}),
      job.submitter ? h("span", {class: "muted small",
                                 text: `submitted on ${who(job.submitter)}`}) : null,
      h("span", {class: `badge job-${job.state}`, text: job.state}),
      h("span", {class: "small", text: `step ${job.step ?? 0} / ${job.steps ?? "?"}`}),
      h("div", {class: "progress"}, h("div", {style: `width:${pct.toFixed(1)}%`}))),
    figs,
    h("div", {class: "job-body"},
      h("div", {},
        h("div", {class: "chart-legend"}, h("span", {class: "train", text: "train loss"}),
          hasHeld ? h("span", {class: "held-out", text: "held-out loss"}) :
                    h("span", {class: "muted", text: "(no held-out loss for this job)"})),
        lossChart(job, pts)),
      h("div", {}, stagesTable(job), h("div", {style: "height:.6em"}), edgesTable(job))),
    Object.keys(job.idle || {}).length ? h("p", {class: "muted small", text: "idle: " +
      Object.entries(job.idle).map(([m, why]) => `${short(m)}: ${why}`).join("; ")}) : null,
    job.failure ? h("div", {class: "failure", text: job.failure}) : null);
  return card;
}

function renderJobs(snap) {
  const cards = snap.jobs.map(renderJob);
  const note = [];
  if (snap.hidden_jobs) note.push(`${snap.hidden_jobs} job(s) of other users hidden`);
  if (snap.cluster_note) note.push(`other members' jobs: ${snap.cluster_note}`);
  note.push(`as ${snap.viewer.who}${snap.viewer.operator ? " (operator)" : ""}`);
  document.getElementById("jobs-note").textContent = note.join(" · ");
  document.getElementById("jobs").replaceChildren(
    ...(cards.length ? cards : [h("p", {class: "muted", text: "no jobs yet: " +
        "fusionctl submit JOB.toml"})]));
}

function render(snap) {
  lastSnapshot = snap;
  names = new Map(snap.cluster.members.filter((m) => m.name).map((m) => [m.node_id, m.name]));
  renderCluster(snap.cluster);
  renderLinks(snap.links, snap.cluster.members);
  renderJobs(snap);
  document.body.dataset.updated = String(snap.at);
}

// -- the live stream (server-sent events, read with fetch so the token is a header) -------

function setLive(on, text) {
  const el = document.getElementById("live");
  el.className = `live ${on ? "on" : "off"}`;
  el.textContent = text;
}

async function follow(token) {
  let backoff = 500;
  for (;;) {
    try {
      const resp = await fetch("/api/events", {headers: {Authorization: `Bearer ${token}`},
                                               cache: "no-store"});
      if (resp.status === 401) {
        sessionStorage.removeItem(TOKEN_KEY);
        showLogin("this dashboard session expired or is unknown to the daemon " +
                  "(it restarted?): run `fusionctl dashboard` for a new link");
        return;
      }
      if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
      setLive(true, "live");
      backoff = 500;
      const reader = resp.body.getReader();
      const dec = new TextDecoder();
      let buf = "";
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        buf += dec.decode(value, {stream: true});
        let i;
        while ((i = buf.indexOf("\n\n")) >= 0) {
          const block = buf.slice(0, i);
          buf = buf.slice(i + 2);
          let event = "message", data = "";
          for (const line of block.split("\n")) {
            if (line.startsWith("event: ")) event = line.slice(7);
            else if (line.startsWith("data: ")) data += line.slice(6);
          }
          if (event === "snapshot") {
            render(JSON.parse(data));
          } else if (event === "expired") {
            sessionStorage.removeItem(TOKEN_KEY);
            showLogin("this dashboard session expired: run `fusionctl dashboard` for a new link");
            return;
          }
        }
      }
    } catch (e) {
      // the daemon went away or restarted: try again, more slowly each time
    }
    setLive(false, "reconnecting");
    await new Promise((r) => setTimeout(r, backoff));
    backoff = Math.min(backoff * 2, 10000);
    // a reconnect starts a fresh stream: every job's points come again whole
  }
}

function showLogin(why) {
  setLive(false, "no session");
  const n = document.getElementById("notice");
  n.hidden = false;
  n.textContent = why;
}

let following = false;

function start() {
  const token = takeToken();
  if (!token) {
    showLogin("open the dashboard with `fusionctl dashboard`: it prints a link with a " +
              "session for your user (the daemon shows each user their own jobs)");
    return;
  }
  if (following) return;
  following = true;
  document.getElementById("notice").hidden = true;
  follow(token).finally(() => { following = false; });
}

document.addEventListener("DOMContentLoaded", start);
// a link pasted into a tab already showing the page changes only the fragment: no reload
window.addEventListener("hashchange", start);
