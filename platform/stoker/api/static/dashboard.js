// Stoker's web dashboard: reads the admin API with the key the user gave this tab, draws SVG.
// The key lives in sessionStorage only (this tab, until it closes) and goes out only as the bearer
// header of same-origin calls; a key in the address's fragment (#key=…) is taken and wiped at once.
"use strict";
(() => {
  const KEY = "stoker.adminKey";
  const SVG = "http://www.w3.org/2000/svg";
  const W = 640, H = 200, L = 48, R = 8, T = 8, B = 22; // the charts' viewBox and margins
  const STATES = [
    ["READY", "hot", "#1a7f37"], ["SLEEPING", "asleep", "#8250df"], ["STARTING", "starting", "#d4a72c"],
    ["PENDING", "pending", "#bf8700"], ["DRAINING", "draining", "#0969da"], ["FAILED", "failed", "#cf222e"],
  ];
  const TIERS = { wake: "#8250df", page_cache: "#0969da", disk: "#d4a72c", object_storage: "#cf222e" };
  const $ = (id) => document.getElementById(id);
  let history = { points: [], interval_s: 5 };
  let deployments = [];

  function takeKeyFromFragment() {
    const m = /(?:^#|&)key=([^&]*)/.exec(location.hash);
    if (m) {
      sessionStorage.setItem(KEY, decodeURIComponent(m[1]));
      window.history.replaceState(null, "", location.pathname + location.search);
    }
  }

  class AuthError extends Error {}

  async function api(path) {
    const key = sessionStorage.getItem(KEY);
    const response = await fetch(path, {
      headers: key ? { authorization: "Bearer " + key } : {},
      cache: "no-store", credentials: "omit", referrerPolicy: "no-referrer",
    });
    if (response.status === 401) throw new AuthError("the admin key was refused");
    if (!response.ok) {
      const error = new Error(path + ": HTTP " + response.status);
      error.status = response.status;
      throw error;
    }
    return response.json();
  }

  function el(tag, attrs, text) {
    const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = String(text);
    return node;
  }

  function table(node, header, rows) {
    node.replaceChildren(el("tr"));
    for (const h of header) node.firstChild.append(el("th", {}, h));
    for (const row of rows) {
      const tr = el("tr");
      for (const cell of row) tr.append(el("td", {}, cell === null || cell === undefined ? "–" : cell));
      node.append(tr);
    }
  }

  function legend(node, series) {
    node.replaceChildren(...series.map((s) => el("span", { style: "--c:" + s.color }, s.name)));
  }

  function clock(t, seconds = true) {
    return new Date(t * 1000).toTimeString().slice(0, seconds ? 8 : 5);
  }

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    return [1, 2, 2.5, 5, 10].map((m) => m * p).find((m) => m >= v);
  }

  // series: [{name, color, values: [number|null per point], dashed?, area?}]; `stacked` piles areas.
  function chart(svg, times, series, { stacked = false, bars = false } = {}) {
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    svg.replaceChildren();
    const n = times.length;
    const sums = times.map((_, i) => series.reduce((a, s) => a + (s.values[i] || 0), 0));
    const top = niceMax(stacked || bars ? Math.max(0, ...sums) : Math.max(0, ...series.flatMap((s) => s.values.filter((v) => v !== null))));
    const t0 = n ? times[0] : 0, t1 = n > 1 ? times[n - 1] : t0 + 1;
    const x = (t) => L + ((t - t0) / (t1 - t0 || 1)) * (W - L - R);
    const y = (v) => H - B - (v / top) * (H - T - B);
    for (const f of [0, 0.5, 1]) {
      svg.append(el("svg:line", { x1: L, x2: W - R, y1: y(top * f), y2: y(top * f), stroke: "#eaeef2" }));
      svg.append(el("svg:text", { x: L - 4, y: y(top * f) + 4, "text-anchor": "end", "font-size": 11, fill: "#57606a" }, +(top * f).toPrecision(3)));
    }
    if (n) {
      const seconds = t1 - t0 < 600;
      svg.append(el("svg:text", { x: L, y: H - 6, "font-size": 11, fill: "#57606a" }, clock(t0, seconds)));
      svg.append(el("svg:text", { x: W - R, y: H - 6, "text-anchor": "end", "font-size": 11, fill: "#57606a" }, clock(t1, seconds)));
    }
    const base = times.map(() => 0);
    const slot = Math.max(2, (W - L - R) / Math.max(n, 1) - 1);
    for (const s of series) {
      if (bars) {
        times.forEach((t, i) => {
          const v = s.values[i] || 0;
          if (v > 0) svg.append(el("svg:rect", { x: x(t) - slot / 2, y: y(base[i] + v), width: slot, height: y(base[i]) - y(base[i] + v), fill: s.color }));
          base[i] += v;
        });
      } else if (stacked) {
        const upper = times.map((t, i) => `${x(t)},${y(base[i] + (s.values[i] || 0))}`);
        const lower = times.map((t, i) => `${x(t)},${y(base[i])}`).reverse();
        svg.append(el("svg:polygon", { points: upper.concat(lower).join(" "), fill: s.color, "fill-opacity": 0.75, stroke: s.color }));
        times.forEach((_, i) => { base[i] += s.values[i] || 0; });
      } else {
        let d = "";
        times.forEach((t, i) => {
          const v = s.values[i];
          if (v === null || v === undefined) return;
          d += (d && s.values[i - 1] !== null && s.values[i - 1] !== undefined ? "L" : "M") + x(t) + "," + y(v);
        });
        if (d) svg.append(el("svg:path", { d, fill: "none", stroke: s.color, "stroke-width": 2, "stroke-dasharray": s.dashed ? "6 4" : "none" }));
      }
    }
    svg.dataset.points = String(n);
  }

  // The selected deployment's figures of each point, or the sum of every deployment's.
  const scaled = (rate, dt) => (rate === null ? null : rate * dt);

  function pick(point, field, sub) {
    const chosen = $("deployment").value;
    let total = null;
    for (const [name, d] of Object.entries(point.deployments)) {
      if (chosen && name !== chosen) continue;
      let v = d[field];
      if (sub !== undefined) v = v ? v[sub] : null;
      if (v === null || v === undefined) continue;
      total = (total || 0) + v;
    }
    return total;
  }

  // Per-second rates over the last ~10 s of points (at least one): counters that move once a second
  // (cost, instance-seconds) read at a shorter interval would otherwise zigzag between 0 and twice.
  function windowed(points, amount) {
    const k = Math.max(1, Math.round(10 / (history.interval_s || 5)));
    return points.map((p, i) => {
      let sum = null, dt = 0;
      for (const q of points.slice(Math.max(0, i - k + 1), i + 1)) {
        const v = amount(q);
        dt += q.dt;
        if (v !== null) sum = (sum || 0) + v;
      }
      return sum === null ? null : sum / dt;
    });
  }

  function show(v) {
    if (v === null || v === undefined) return null;
    if (typeof v === "number") return Number.isInteger(v) ? v : +v.toPrecision(4);
    if (Array.isArray(v)) return `${v.length}`;
    if (typeof v === "object") return Object.entries(v).map(([k, x]) => `${k} ${show(x)}`).join(", ");
    return v;
  }

  function drawDeployments() {
    const rows = deployments.map((d) => {
      const states = Object.entries(d.instances || {}).filter(([, n]) => n).map(([s, n]) => `${s} ${n}`).join(", ");
      const traffic = Object.entries(d.traffic || {}).map(([r, p]) => `r${r} ${p}%`).join(", ");
      const decision = d.decision ? `${d.decision.ready} ready, ${d.decision.sleeping} asleep (${d.decision.reason})` : null;
      const forecast = d.decision && d.decision.forecast !== null ? (+d.decision.forecast).toFixed(2) : null;
      const trouble = d.unavailable || (d.failed_starts ? `${d.failed_starts} failed starts` : "");
      return [d.name, d.engine, d.latest_revision, traffic, states || "none", decision, forecast, trouble];
    });
    table($("deployments"), ["name", "engine", "revision", "traffic", "instances", "scaler", "forecast req/s", "trouble"], rows);
    const select = $("deployment"), chosen = select.value;
    const names = deployments.map((d) => d.name);
    select.replaceChildren(el("option", { value: "" }, "all"), ...names.map((n) => el("option", { value: n }, n)));
    select.value = names.includes(chosen) ? chosen : "";
  }

  function drawHistory() {
    const points = history.points;
    const times = points.map((p) => p.t);
    const requests = [
      { name: "arrivals/s", color: "#0969da", values: windowed(points, (p) => scaled(pick(p, "arrivals_per_s"), p.dt)) },
      { name: "forecast", color: "#8250df", dashed: true, values: points.map((p) => pick(p, "forecast_per_s")) },
      { name: "answers/s", color: "#1a7f37", values: windowed(points, (p) => scaled(pick(p, "requests_per_s"), p.dt)) },
      { name: "5xx/s", color: "#cf222e", values: windowed(points, (p) => scaled(pick(p, "errors_per_s"), p.dt)) },
      { name: "held now", color: "#d4a72c", values: points.map((p) => pick(p, "queued")) },
    ];
    chart($("chart-requests"), times, requests);
    legend($("legend-requests"), requests);

    const instances = STATES.map(([state, tier, color]) => ({ name: `${tier} (${state})`, color, values: points.map((p) => pick(p, "instances", state) || 0) }));
    chart($("chart-instances"), times, instances, { stacked: true });
    legend($("legend-instances"), instances);

    const cold = Object.entries(TIERS).map(([tier, color]) => ({ name: tier, color, values: points.map((p) => pick(p, "cold_starts", tier) || 0) }));
    chart($("chart-cold"), times, cold, { bars: true });
    legend($("legend-cold"), cold);
    const chosen = $("deployment").value;
    const rows = [];
    for (const p of points.slice().reverse()) {
      for (const [name, d] of Object.entries(p.deployments)) {
        const waited = Object.keys(d.cold_starts).length || Object.keys(d.start_s).length || d.hold_s !== null;
        if ((chosen && name !== chosen) || !waited) continue;
        const tiers = Object.entries(d.cold_starts).map(([t, n]) => `${t} ×${n}`).join(", ");
        const starts = Object.entries(d.start_s).map(([t, s]) => `${t} ${s}s`).join(", ");
        rows.push([clock(p.t), name, tiers || null, starts || null, d.hold_s === null ? null : d.hold_s + " s"]);
      }
      if (rows.length >= 12) break;
    }
    table($("cold-table"), ["at", "deployment", "cold requests by tier", "starts: to READY (mean)", "held (mean)"], rows);
  }

  async function drawCost() {
    const points = history.points;
    const body = $("cost-body");
    const costed = points.some((p) => Object.values(p.deployments).some((d) => d.cost_usd !== null));
    const perHour = (field, sub) => windowed(points, (p) => pick(p, field, sub)).map((v) => (v === null ? null : v * 3600));
    const series = costed
      ? [{ name: "USD per hour", color: "#1a7f37", values: perHour("cost_usd") }]
      : STATES.map(([state, tier, color]) => ({ name: `${tier} instance-hours per hour`, color, values: perHour("instance_seconds", state).map((v) => v || 0) }));
    chart($("chart-cost"), points.map((p) => p.t), series, { stacked: !costed });
    legend($("legend-cost"), series);
    try {
      const cost = await api("/admin/v1/cost?since=1h");
      const rows = Array.isArray(cost.data) ? cost.data.filter((r) => !$("deployment").value || r.deployment === $("deployment").value) : null;
      if (rows && rows.length) {
        const header = Object.keys(rows[0]);
        body.replaceChildren(el("p", { class: "note" }, "The last hour, from /admin/v1/cost (revisions: how many)."), el("div", { class: "scroll" }, ""));
        body.lastChild.append(el("table"));
        table(body.lastChild.firstChild, header, rows.map((r) => header.map((h) => show(r[h]))));
      } else {
        body.replaceChildren(el("pre", {}, JSON.stringify(cost, null, 1)));
      }
    } catch (error) {
      if (error instanceof AuthError) throw error;
      body.replaceChildren(el("p", { class: "note" }, error.status === 404
        ? "No cost API on this platform (/admin/v1/cost): instance-hours by state shown instead, the base of cost."
        : "cost: " + error.message));
    }
  }

  async function refresh() {
    if (!sessionStorage.getItem(KEY)) {
      document.body.dataset.state = "need-key";
      $("status").textContent = "paste the admin key to see the figures";
      return;
    }
    try {
      [history, deployments] = await Promise.all([
        api("/admin/v1/history"),
        api("/admin/v1/deployments").then((r) => r.data),
      ]);
      drawDeployments();
      drawHistory();
      await drawCost();
      document.body.dataset.state = "ok";
      document.body.dataset.points = String(history.points.length);
      $("status").textContent = `${deployments.length} deployments, ${history.points.length} points every ${history.interval_s} s; updated ${new Date().toLocaleTimeString()}`;
      if (history.points.length && deployments.length) document.body.dataset.ready = "true";
    } catch (error) {
      document.body.dataset.state = error instanceof AuthError ? "need-key" : "error";
      $("status").textContent = error.message;
      $("status").className = "bad";
      return;
    }
    $("status").className = "";
  }

  takeKeyFromFragment();
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    if ($("key").value) sessionStorage.setItem(KEY, $("key").value);
    $("key").value = "";
    refresh();
  });
  $("forget").addEventListener("click", () => { sessionStorage.removeItem(KEY); refresh(); });
  $("deployment").addEventListener("change", () => { drawHistory(); drawCost().catch(() => {}); });
  // Every history interval (read from the first answer), at least once a second.
  refresh().then(() => setInterval(refresh, Math.max(1000, (history.interval_s || 5) * 1000)));
  window.addEventListener("focus", refresh);
})();
