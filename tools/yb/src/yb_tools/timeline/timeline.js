// The scheduling timeline: lanes per instance on one canvas, a decision panel.
//
// The data comes from yb_tools/timeline/model.py (see its structs). Rows are arrays;
// their column names travel in meta.*_fields and are looked up by name here, so the
// Python side can add a column without breaking this file.
//
// Everything is drawn on one <canvas>: 10,000 requests are 10,000 rectangles, which a
// canvas draws in milliseconds where as many DOM nodes would take seconds to lay out.
// Hit-testing is done by hand against the same geometry the drawing uses.
"use strict";
(() => {
  const data = JSON.parse(document.getElementById("yb-data").textContent);
  const meta = data.meta;
  const col = (fields) => Object.fromEntries(fields.map((name, i) => [name, i]));
  const R = col(meta.request_fields);
  const T = col(meta.transfer_fields);
  const M = col(meta.marker_fields);
  const requests = data.requests;
  const lanes = data.lanes;
  // The planner's decisions (PoolPlanned), each with its actions and pools.
  const plans = data.plans || [];
  const P = col(meta.plan_fields || []);
  const PO = col(meta.pool_fields || []);
  const A = col(meta.action_fields || []);

  // --- geometry ------------------------------------------------------------------
  const GUTTER = 118; // lane labels
  const AXIS = 26;
  const HEIGHT = { conductor: 22, planner: 40, prefill: 28, decode: 30, kvstore: 18 };
  const BRANCH_COLORS = {
    recompute: "#7f8fa6", local: "#2e8b57", transfer: "#e08a1e",
    reject: "#d92d20", "": "#98a2b3",
  };
  const ROLE_SHADE = {
    prefill: "#f2f6fc", decode: "#f4fbf6", kvstore: "#fbf7f0", conductor: "#f6f6f7", planner: "#f8f6fc",
  };
  // The planner lane: a glyph per action, and each pool's serving count as a step line.
  const ACTION_COLORS = { add: "#2e8b57", drain: "#e08a1e", move: "#6941c6" };
  const POOL_COLORS = { prefill: "#175cd3", decode: "#2e8b57" };
  const OUTCOME = Object.fromEntries(meta.outcomes.map((name, i) => [name, i]));

  // Row 0 is the conductor's lane (admissions, refusals); then the planner's when the
  // log has its decisions; then one per instance.
  const rows = [{ id: "conductor", role: "conductor", host: "", index: -1 }];
  if (plans.length) rows.push({ id: "planner", role: "planner", host: "", index: -1 });
  const FIRST_LANE = rows.length;
  rows.push(...lanes.map(([id, role, host], index) => ({ id, role, host, index })));
  let y = AXIS;
  for (const row of rows) {
    row.y = y;
    row.h = HEIGHT[row.role] || 20;
    y += row.h;
  }
  const totalHeight = y + 4;
  const rowOfLane = (lane) => rows[lane + FIRST_LANE];
  const plannerRow = plans.length ? rows[1] : null;

  // Per request, the spans drawn on its prefill lane: q0 (decided) .. c0 (started)
  // is the queue wait, c0 .. c1 the prefill itself. A log may lack a stage (a live
  // request still queued, a cancelled one): the span ends at what the log has.
  const spans = requests.map((r) => {
    const q0 = r[R.decided] ?? r[R.admitted];
    const c1 = r[R.prefilled] ?? r[R.committed] ?? r[R.ended] ?? meta.t_end;
    const c0 = r[R.started] ?? (r[R.prefilled] != null ? q0 : null);
    return { q0, c0, c1 };
  });
  const byLane = new Map(); // prefill lane -> request indexes
  requests.forEach((r, i) => {
    const lane = r[R.prefill];
    if (lane < 0) return;
    if (!byLane.has(lane)) byLane.set(lane, []);
    byLane.get(lane).push(i);
  });
  const byId = new Map(requests.map((r, i) => [r[R.id], i]));
  const downSpans = []; // [lane, from, to]: an instance down until it comes up again
  const drainSpans = []; // [lane, from, to]: an instance draining until it goes down
  {
    const open = new Map();
    const draining = new Map();
    const sorted = data.markers.slice().sort((a, b) => a[M.time] - b[M.time]);
    for (const m of sorted) {
      const kind = meta.marker_kinds[m[M.kind]];
      if (kind === "draining" && !draining.has(m[M.lane])) draining.set(m[M.lane], m[M.time]);
      if ((kind === "down" || kind === "up") && draining.has(m[M.lane])) {
        drainSpans.push([m[M.lane], draining.get(m[M.lane]), m[M.time]]);
        draining.delete(m[M.lane]);
      }
      if (kind === "down" && !open.has(m[M.lane])) open.set(m[M.lane], m[M.time]);
      if (kind === "up" && open.has(m[M.lane])) {
        downSpans.push([m[M.lane], open.get(m[M.lane]), m[M.time]]);
        open.delete(m[M.lane]);
      }
    }
    for (const [lane, from] of open) downSpans.push([lane, from, Infinity]);
    for (const [lane, from] of draining) drainSpans.push([lane, from, Infinity]);
  }

  // --- view state ----------------------------------------------------------------
  const span = Math.max(meta.t_end, 1e-3);
  const view = { t0: -span * 0.01, t1: span * 1.01 };
  const layers = { queue: true, transfers: true, handoffs: false, changedOnly: false };
  let selected = -1;
  let selectedPlan = -1; // a planner decision shown in the panel (not with a request)
  const canvas = document.getElementById("yb-canvas");
  const ctx = canvas.getContext("2d");
  let width = 0;

  const plotWidth = () => Math.max(10, width - GUTTER - 8);
  const xOf = (t) => GUTTER + ((t - view.t0) / (view.t1 - view.t0)) * plotWidth();
  const tOf = (x) => view.t0 + ((x - GUTTER) / plotWidth()) * (view.t1 - view.t0);

  function resize() {
    const dpr = window.devicePixelRatio || 1;
    width = canvas.parentElement.clientWidth;
    canvas.style.height = totalHeight + "px";
    canvas.width = Math.round(width * dpr);
    canvas.height = Math.round(totalHeight * dpr);
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  }

  // A round step for about `n` ticks over `range` seconds: 1, 2 or 5 times 10^k.
  function tickStep(range, n) {
    const raw = range / n;
    const p = Math.pow(10, Math.floor(Math.log10(raw)));
    return [1, 2, 5, 10].map((m) => m * p).find((s) => s >= raw);
  }
  function fmtSeconds(t, step) {
    const digits = Math.max(0, -Math.floor(Math.log10(step)));
    return t.toFixed(Math.min(digits, 4)) + " s";
  }

  // --- drawing -------------------------------------------------------------------
  const drawn = {
    bars: 0, transfers: 0, rejections: 0, downs: 0, drains: 0, handoffs: 0, series: 0,
    plans: 0, actions: 0, pools: 0,
  };

  function draw() {
    for (const k in drawn) drawn[k] = 0;
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, width, totalHeight);
    ctx.font = "11px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    for (const row of rows) {
      ctx.fillStyle = ROLE_SHADE[row.role] || "#fff";
      ctx.fillRect(0, row.y, width, row.h);
      ctx.fillStyle = "#e4e7ec";
      ctx.fillRect(0, row.y + row.h - 1, width, 1);
    }
    drawAxis();
    ctx.save();
    ctx.beginPath();
    ctx.rect(GUTTER, 0, width - GUTTER, totalHeight);
    ctx.clip();
    drawSeries();
    drawDown();
    drawPrefill();
    drawConductorLane();
    drawPlanner();
    if (layers.handoffs) drawHandoffs(-1);
    if (layers.transfers) drawTransfers(-1);
    drawMarkers();
    drawSelection();
    ctx.restore();
    drawLabels();
    document.getElementById("yb-view").textContent =
      `view ${fmtSeconds(view.t0, view.t1 - view.t0)} .. ${fmtSeconds(view.t1, view.t1 - view.t0)}`;
    // A summary of what was drawn, for tests and for anyone inspecting the page.
    Object.assign(canvas.dataset, {
      lanes: String(lanes.length), requests: String(requests.length),
      bars: String(drawn.bars), transfers: String(drawn.transfers),
      rejections: String(drawn.rejections), downs: String(drawn.downs),
      drains: String(drawn.drains),
      series: String(drawn.series), handoffs: String(drawn.handoffs),
      plans: String(drawn.plans), actions: String(drawn.actions), pools: String(drawn.pools),
    });
  }

  function drawAxis() {
    const step = tickStep(view.t1 - view.t0, Math.max(2, plotWidth() / 110));
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, width, AXIS);
    ctx.fillStyle = "#667085";
    ctx.textAlign = "center";
    for (let t = Math.ceil(view.t0 / step) * step; t <= view.t1; t += step) {
      const x = xOf(t);
      if (x < GUTTER) continue;
      ctx.fillText(fmtSeconds(t, step), x, AXIS / 2);
      ctx.fillStyle = "#eaecf0";
      ctx.fillRect(Math.round(x), AXIS, 1, totalHeight - AXIS);
      ctx.fillStyle = "#667085";
    }
    ctx.textAlign = "left";
  }

  function drawLabels() {
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, GUTTER, totalHeight);
    ctx.fillStyle = "#1d2330";
    ctx.fillText(meta.wall_clock ? "t - t0" : "sim time", 6, AXIS / 2);
    const seriesOf = new Map(data.series.map((s) => [s[0], s]));
    for (const row of rows) {
      ctx.fillStyle = ROLE_SHADE[row.role] || "#fff";
      ctx.fillRect(0, row.y, GUTTER, row.h - 1);
      ctx.fillStyle = "#1d2330";
      ctx.fillText(row.id, 6, row.y + row.h / 2 - (row.h > 24 ? 5 : 0));
      const s = seriesOf.get(row.index);
      if (row.h > 24) {
        ctx.fillStyle = "#667085";
        const note = s && row.role === "decode" ? `batch, max ${s[3]}`
          : row.role === "planner" ? "pools, actions" : row.role;
        ctx.fillText(note, 6, row.y + row.h / 2 + 7);
      }
    }
  }

  // Load as a step area: the decode batch, a kvstore's pool use, a prefill's queue.
  function drawSeries() {
    for (const [lane, times, values, scale] of data.series) {
      const row = rowOfLane(lane);
      if (!row || !times.length) continue;
      const color = row.role === "decode" ? "rgba(46,139,87,.35)" : row.role === "kvstore" ? "rgba(224,138,30,.30)" : "rgba(127,143,166,.18)";
      const base = row.y + row.h - 1;
      const top = row.role === "prefill" ? row.h * 0.35 : row.h - 3;
      ctx.fillStyle = color;
      ctx.beginPath();
      let lastX = null;
      for (let i = 0; i < times.length; i++) {
        const x0 = xOf(times[i]);
        const x1 = i + 1 < times.length ? xOf(times[i + 1]) : xOf(meta.t_end);
        if (x1 < GUTTER - 1) continue; // left of the view
        const h = Math.min(1, values[i] / scale) * top;
        if (lastX === null) ctx.moveTo(x0, base);
        ctx.lineTo(x0, base - h);
        ctx.lineTo(x1, base - h);
        lastX = x1;
        if (x1 > width) break;
      }
      if (lastX === null) continue;
      ctx.lineTo(lastX, base);
      ctx.closePath();
      ctx.fill();
      drawn.series++;
    }
  }

  function drawDown() {
    const shade = (spans, colour) => {
      ctx.fillStyle = colour;
      for (const [lane, from, to] of spans) {
        const row = rowOfLane(lane);
        const x0 = xOf(from);
        const x1 = Math.min(xOf(Math.min(to, view.t1 + 1)), width);
        if (x1 >= GUTTER) ctx.fillRect(x0, row.y, x1 - x0, row.h - 1);
      }
    };
    shade(drainSpans, "rgba(224,138,30,.14)");
    shade(downSpans, "rgba(217,45,32,.12)");
  }

  const visible = (i) => !layers.changedOnly || requests[i][R.what_if] === 1;

  function drawPrefill() {
    for (const [lane, list] of byLane) {
      const row = rowOfLane(lane);
      for (let k = 0; k < list.length; k++) {
        const i = list[k];
        if (!visible(i)) continue;
        const s = spans[i];
        if (s.c1 < view.t0 || s.q0 > view.t1) continue;
        const r = requests[i];
        if (layers.queue && (s.c0 ?? s.c1) > s.q0) {
          // Queue waits overlap (FIFO): three thin rows keep neighbours apart.
          const qy = row.y + row.h - 4 - (k % 3) * 2;
          ctx.fillStyle = "rgba(102,112,133,.45)";
          ctx.fillRect(xOf(s.q0), qy, Math.max(1, xOf(s.c0 ?? s.c1) - xOf(s.q0)), 1);
        }
        if (s.c0 == null) continue;
        const x0 = xOf(s.c0);
        const w = Math.max(1, xOf(s.c1) - x0);
        ctx.fillStyle = BRANCH_COLORS[meta.branches[r[R.branch]]] || "#98a2b3";
        ctx.fillRect(x0, row.y + 3, w, row.h - 11);
        const outcome = meta.outcomes[r[R.outcome]];
        if (outcome !== "completed" && outcome !== "in_flight") {
          ctx.fillStyle = "#d92d20"; // refused at decode, failed or cancelled
          ctx.fillRect(x0 + w - Math.min(3, w), row.y + 3, Math.min(3, w), row.h - 11);
        }
        drawn.bars++;
      }
    }
  }

  function drawConductorLane() {
    const row = rows[0];
    for (let i = 0; i < requests.length; i++) {
      if (!visible(i)) continue;
      const r = requests[i];
      const x = xOf(r[R.admitted]);
      if (x < GUTTER - 4 || x > width + 4) continue;
      if (meta.outcomes[r[R.outcome]] === "rejected") {
        ctx.fillStyle = "#d92d20";
        ctx.beginPath();
        ctx.moveTo(x, row.y + row.h - 3);
        ctx.lineTo(x - 4, row.y + 4);
        ctx.lineTo(x + 4, row.y + 4);
        ctx.fill();
        drawn.rejections++;
      } else {
        ctx.fillStyle = "rgba(102,112,133,.5)";
        ctx.fillRect(x, row.y + row.h - 7, 1, 5);
      }
    }
  }

  // The planner lane: each pool's serving count as a step line over the lower part
  // (its scale is the budget), and at each decision a tick, or a glyph per action
  // with a short label (+P: add prefill, -D: drain decode, D>P: move to prefill).
  const poolOf = (plan, role) => plan[P.pools].find((pool) => pool[PO.role] === role);
  const planScale = Math.max(1, ...plans.map((plan) => Math.max(plan[P.max_instances],
    ...plan[P.pools].map((pool) => Math.max(pool[PO.serving] + pool[PO.starting], pool[PO.target])))));
  const ROLE_LETTER = { prefill: "P", decode: "D" };
  const actionLabel = (a) => a[A.action] === "add" ? `+${ROLE_LETTER[a[A.role]] || a[A.role]}`
    : a[A.action] === "drain" ? `\u2212${ROLE_LETTER[a[A.role]] || a[A.role]}`
    : `\u2192${ROLE_LETTER[a[A.role]] || a[A.role]}`;

  function drawPlanner() {
    const row = plannerRow;
    if (!row) return;
    const base = row.y + row.h - 3;
    const top = row.h - 18; // the glyphs keep the upper part
    ctx.lineWidth = 1.5;
    for (const role of ["prefill", "decode"]) {
      ctx.strokeStyle = POOL_COLORS[role];
      ctx.beginPath();
      let started = false;
      for (let k = 0; k < plans.length; k++) {
        const pool = poolOf(plans[k], role);
        if (!pool) continue;
        const x0 = xOf(plans[k][P.time]);
        const x1 = k + 1 < plans.length ? xOf(plans[k + 1][P.time]) : xOf(meta.t_end);
        // Offset by a pixel per role, so equal counts stay two lines.
        const yv = base - (pool[PO.serving] / planScale) * top - (role === "decode" ? 2 : 0);
        if (!started) { ctx.moveTo(x0, yv); started = true; } else ctx.lineTo(x0, yv);
        ctx.lineTo(x1, yv);
      }
      if (started) { ctx.stroke(); drawn.pools++; }
    }
    for (let k = 0; k < plans.length; k++) {
      const plan = plans[k];
      const x = xOf(plan[P.time]);
      if (x < GUTTER - 30 || x > width + 6) continue;
      const actions = plan[P.actions];
      drawn.plans++;
      if (!actions.length) {
        ctx.fillStyle = "rgba(102,112,133,.55)";
        ctx.fillRect(x, row.y + 3, 1, 6);
        continue;
      }
      ctx.fillStyle = "rgba(105,65,198,.5)";
      ctx.fillRect(x, row.y + 2, 1, row.h - 4);
      actions.forEach((a, j) => {
        const c = ACTION_COLORS[a[A.action]] || "#667085";
        const gx = x + 4 + j * 28;
        const gy = row.y + 8;
        ctx.fillStyle = c;
        ctx.beginPath();
        if (a[A.action] === "add") {
          ctx.moveTo(gx, gy + 4); ctx.lineTo(gx + 4, gy - 4); ctx.lineTo(gx + 8, gy + 4);
        } else if (a[A.action] === "drain") {
          ctx.moveTo(gx, gy - 4); ctx.lineTo(gx + 4, gy + 4); ctx.lineTo(gx + 8, gy - 4);
        } else {
          ctx.moveTo(gx + 4, gy - 4); ctx.lineTo(gx + 8, gy); ctx.lineTo(gx + 4, gy + 4); ctx.lineTo(gx, gy);
        }
        ctx.fill();
        ctx.fillText(actionLabel(a), gx + 10, gy);
        drawn.actions++;
      });
    }
    if (selectedPlan >= 0) {
      const x = xOf(plans[selectedPlan][P.time]);
      ctx.strokeStyle = "#1d2330";
      ctx.lineWidth = 2;
      ctx.strokeRect(x - 3, row.y + 1, 6, row.h - 3);
      dashedRule(x);
    }
  }

  // A dashed rule down the whole chart at `x`, in the current stroke colour: where a
  // selected decision happened.
  function dashedRule(x) {
    ctx.setLineDash([4, 3]);
    ctx.lineWidth = 1;
    ctx.beginPath();
    ctx.moveTo(x, AXIS);
    ctx.lineTo(x, totalHeight);
    ctx.stroke();
    ctx.setLineDash([]);
  }

  function arrow(xa, ya, xb, yb, color, lineWidth) {
    ctx.strokeStyle = color;
    ctx.fillStyle = color;
    ctx.lineWidth = lineWidth;
    ctx.beginPath();
    ctx.moveTo(xa, ya);
    ctx.lineTo(xb, yb);
    ctx.stroke();
    const a = Math.atan2(yb - ya, xb - xa);
    ctx.beginPath();
    ctx.moveTo(xb, yb);
    ctx.lineTo(xb - 6 * Math.cos(a - 0.4), yb - 6 * Math.sin(a - 0.4));
    ctx.lineTo(xb - 6 * Math.cos(a + 0.4), yb - 6 * Math.sin(a + 0.4));
    ctx.fill();
  }

  // Transfers: source lane -> target lane over the estimated transfer time; only
  // those of request `only` when it is >= 0 (the selection).
  function drawTransfers(only) {
    for (const t of data.transfers) {
      if (only >= 0 && t[T.request] !== only) continue;
      if (only < 0 && t[T.request] >= 0 && !visible(t[T.request])) continue;
      const xa = xOf(t[T.start]);
      const xb = Math.max(xOf(t[T.end]), xa + 3);
      if (xb < GUTTER || xa > width) continue;
      const src = rowOfLane(t[T.source]);
      const dst = rowOfLane(t[T.target]);
      const replication = meta.transfer_kinds[t[T.kind]] === "replication";
      const color = only >= 0 ? "#b54708" : replication ? "rgba(105,65,198,.7)" : "rgba(224,138,30,.55)";
      arrow(xa, src.y + src.h / 2, xb, dst.y + dst.h / 2, color, only >= 0 ? 2 : 1);
      drawn.transfers++;
    }
  }

  // Hand-offs: the prefill's end -> the decode instance holding the KV.
  function drawHandoffs(only) {
    const list = only >= 0 ? [only] : requests.keys();
    for (const i of list) {
      if (only < 0 && !visible(i)) continue;
      const r = requests[i];
      const s = spans[i];
      if (r[R.decode] < 0 || r[R.committed] == null) continue;
      const xa = xOf(s.c1);
      const xb = xOf(r[R.committed]);
      if (Math.max(xa, xb) < GUTTER || Math.min(xa, xb) > width) continue;
      const src = rowOfLane(r[R.prefill]);
      const dst = rowOfLane(r[R.decode]);
      arrow(xa, src.y + src.h - 8, Math.max(xb, xa + 2), dst.y + 4, only >= 0 ? "#175cd3" : "rgba(23,92,211,.35)", only >= 0 ? 2 : 1);
      drawn.handoffs++;
    }
  }

  function drawMarkers() {
    for (const m of data.markers) {
      const kind = meta.marker_kinds[m[M.kind]];
      const row = rowOfLane(m[M.lane]);
      const x = xOf(m[M.time]);
      if (x < GUTTER - 6 || x > width + 6) continue;
      if (kind === "down") {
        ctx.fillStyle = "#d92d20";
        ctx.fillRect(x - 1, row.y, 3, row.h - 1);
        ctx.fillText("down", x + 4, row.y + 8);
        drawn.downs++;
      } else if (kind === "up") {
        ctx.fillStyle = "#2e8b57";
        ctx.fillRect(x, row.y, 2, row.h - 1);
      } else if (kind === "draining") {
        ctx.fillStyle = "#e08a1e";
        ctx.fillRect(x - 1, row.y, 3, row.h - 1);
        ctx.fillText("draining", x + 4, row.y + 8);
        drawn.drains++;
      } else {
        ctx.strokeStyle = "#d92d20";
        ctx.lineWidth = 2;
        ctx.beginPath();
        const c = row.y + row.h / 2;
        ctx.moveTo(x - 4, c - 4); ctx.lineTo(x + 4, c + 4);
        ctx.moveTo(x + 4, c - 4); ctx.lineTo(x - 4, c + 4);
        ctx.stroke();
      }
    }
  }

  function drawSelection() {
    if (selected < 0) return;
    const r = requests[selected];
    const s = spans[selected];
    const xa = xOf(r[R.admitted]);
    ctx.strokeStyle = "#1d2330";
    dashedRule(xa);
    const box = boxOf(selected);
    if (box) {
      ctx.strokeStyle = "#1d2330";
      ctx.lineWidth = 2;
      ctx.strokeRect(box.x - 1, box.y - 1, box.w + 2, box.h + 2);
    }
    if (r[R.prefill] >= 0 && s.c0 != null) drawHandoffs(selected);
    drawTransfers(selected);
  }

  // --- hit-testing -----------------------------------------------------------------
  // The box a request is drawn as, in canvas coordinates: its prefill bar, else its
  // queue wait, else (refused at admission) its marker on the conductor's lane.
  function boxOf(i) {
    const r = requests[i];
    const s = spans[i];
    if (r[R.prefill] >= 0) {
      const row = rowOfLane(r[R.prefill]);
      if (s.c0 != null) {
        const x0 = xOf(s.c0);
        return { x: x0, y: row.y + 3, w: Math.max(1, xOf(s.c1) - x0), h: row.h - 11 };
      }
      const x0 = xOf(s.q0);
      return { x: x0, y: row.y + row.h - 8, w: Math.max(2, xOf(s.c1) - x0), h: 6 };
    }
    const row = rows[0];
    return { x: xOf(r[R.admitted]) - 4, y: row.y + 3, w: 8, h: row.h - 6 };
  }

  // The planner decision nearest the pointer on the planner lane (-1: none within
  // 6 px of its tick or the glyphs right of it).
  function hitPlan(x, y) {
    const row = plannerRow;
    if (!row || y < row.y || y >= row.y + row.h || x < GUTTER) return -1;
    let best = -1;
    let bestD = Infinity;
    for (let k = 0; k < plans.length; k++) {
      const px = xOf(plans[k][P.time]);
      const reach = 6 + plans[k][P.actions].length * 28;
      const d = x < px ? px - x : Math.max(0, x - px - reach);
      if (x >= px - 6 && d < bestD) { best = k; bestD = d; }
    }
    // Right of a tick without glyphs, the next decision's tick may be nearer.
    return best >= 0 && bestD <= 6 ? best : -1;
  }

  function hit(x, y) {
    const row = rows.find((rw) => y >= rw.y && y < rw.y + rw.h);
    if (!row || x < GUTTER) return -1;
    const t = tOf(x);
    const slack = 4 * (view.t1 - view.t0) / plotWidth(); // 4 px, in seconds
    let best = -1;
    let bestScore = Infinity;
    const consider = (i, score) => {
      if (visible(i) && score < bestScore) { best = i; bestScore = score; }
    };
    if (row.role === "prefill") {
      for (const i of byLane.get(row.index) || []) {
        const s = spans[i];
        const inBar = s.c0 != null && t >= s.c0 - slack && t <= s.c1 + slack;
        const inQueue = t >= s.q0 - slack && t <= (s.c0 ?? s.c1) + slack;
        // A prefill bar wins over the queue waits lying under it.
        if (inBar) consider(i, Math.abs(t - (s.c0 + s.c1) / 2) / 1e9);
        else if (inQueue && layers.queue) consider(i, 1 + (s.c0 ?? s.c1) - s.q0);
      }
    } else if (row.role === "decode") {
      for (let i = 0; i < requests.length; i++) {
        const r = requests[i];
        if (r[R.decode] !== row.index || r[R.committed] == null) continue;
        const d = Math.abs(r[R.committed] - t);
        if (d <= slack) consider(i, d);
      }
    } else if (row.role === "conductor") {
      for (let i = 0; i < requests.length; i++) {
        const d = Math.abs(requests[i][R.admitted] - t);
        // Refusals first: they are what one looks for on this lane.
        if (d <= slack) consider(i, d + (meta.outcomes[requests[i][R.outcome]] === "rejected" ? 0 : slack));
      }
    }
    return best;
  }

  // --- the decision panel ------------------------------------------------------------
  const packed = document.getElementById("yb-decisions").textContent.trim();
  let texts = null; // Promise of [decisions, what_if_decisions]
  function decisionTexts() {
    if (!texts) {
      texts = (async () => {
        if (typeof DecompressionStream === "undefined") {
          throw new Error("this browser has no DecompressionStream (needs Chrome 80, Firefox 113, Safari 16.4)");
        }
        const bytes = Uint8Array.from(atob(packed), (c) => c.charCodeAt(0));
        const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
        return JSON.parse(await new Response(stream).text());
      })();
    }
    return texts;
  }

  const panel = document.getElementById("yb-decision");
  const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
  const secs = (v) => (v == null ? "-" : v.toFixed(4) + " s");

  const actionText = (a) => a[A.action] === "add" ? `add ${a[A.role]}`
    : a[A.action] === "drain" ? `drain ${a[A.instance]}` : `move ${a[A.instance]} to ${a[A.role]}`;
  const poolText = (pool) => `${pool[PO.role]}: ${pool[PO.serving]} serving, ${pool[PO.starting]} starting, ` +
    `${pool[PO.draining]} draining, needs ${pool[PO.needed].toFixed(2)}, target ${pool[PO.target]}` +
    (pool[PO.held_by] ? ` (${pool[PO.held_by]})` : "");

  // A planner decision in the panel: its actions, its reason, the forecast and both pools.
  function showPlan(k) {
    const plan = plans[k];
    const actions = plan[P.actions];
    const head = ["pool", "serving", "starting", "draining", "needed", "target", "held by"];
    const poolRows = plan[P.pools].map((pool) => [pool[PO.role], pool[PO.serving], pool[PO.starting],
      pool[PO.draining], pool[PO.needed].toFixed(2), pool[PO.target], pool[PO.held_by] || "-"]);
    panel.hidden = false;
    delete panel.dataset.requestId;
    panel.dataset.plan = String(k);
    panel.innerHTML = `<h2>planner decision <span class="rid">${esc(secs(plan[P.time]))}</span>` +
      `<button type="button" class="close" title="Escape">close</button></h2>` +
      `<table class="facts">` +
      `<tr><td>actions</td><td class="actions">${esc(actions.map(actionText).join(", ") || "none")}</td></tr>` +
      `<tr><td>arrivals</td><td>${esc(plan[P.rate].toFixed(2))} req/s, forecast ${esc(plan[P.forecast_rate].toFixed(2))}</td></tr>` +
      `<tr><td>budget</td><td>${esc(plan[P.max_instances] || "instances up")}</td></tr></table>` +
      `<h3>Reason</h3><pre class="reason">${esc(plan[P.reason] || "-")}</pre>` +
      `<h3>Pools</h3><table class="facts pools"><tr>${head.map((h) => `<td>${esc(h)}</td>`).join("")}</tr>` +
      poolRows.map((cells) => `<tr>${cells.map((c) => `<td>${esc(c)}</td>`).join("")}</tr>`).join("") +
      `</table>`;
    panel.querySelector(".close").onclick = () => select(-1);
    panel.dataset.loaded = "true";
  }

  function selectPlan(k) {
    selected = -1;
    selectedPlan = k;
    if (k < 0) select(-1);
    else { showPlan(k); resize(); draw(); }
  }
  // The decision as `yb explain` prints it, its chosen candidates (the lines marked
  // `*`) highlighted.
  const explainBlock = (text) => "<pre>" + text.split("\n").map((line) =>
    line.startsWith("* ") ? `<span class="chosen">${esc(line)}</span>` : esc(line)).join("\n") + "</pre>";

  async function showDecision(i) {
    const r = requests[i];
    const s = spans[i];
    const laneId = (k) => (k >= 0 ? lanes[k][0] : "-");
    const outcome = meta.outcomes[r[R.outcome]];
    const facts = [
      ["outcome", outcome],
      ["placed on", r[R.prefill] >= 0 ? `${laneId(r[R.prefill])} \u2192 ${laneId(r[R.decode])}` : "-"],
      ["path", meta.branches[r[R.branch]] || "-"],
      ["admitted", secs(r[R.admitted])],
      ["queue wait", s.c0 != null ? secs(s.c0 - s.q0) : "-"],
      ["prefill", s.c0 != null ? secs(s.c1 - s.c0) : "-"],
      ["TTFT estimated / measured", `${secs(r[R.est_ttft])} / ${secs(r[R.ttft])}`],
      ["prompt tokens, reused blocks", `${r[R.prompt_tokens]}, ${r[R.reused_blocks]}`],
    ];
    const id = esc(r[R.id]);
    panel.hidden = false;
    panel.dataset.requestId = r[R.id];
    panel.dataset.loaded = "false";
    panel.innerHTML = `<h2>request <span class="rid">${id}</span>` +
      `<button type="button" class="close" title="Escape">close</button></h2>` +
      `<table class="facts">${facts.map(([k, v]) => `<tr><td>${esc(k)}</td><td>${esc(v)}</td></tr>`).join("")}</table>` +
      `<h3>Decision (policy ${esc(meta.policy || "?")})</h3><div class="decision">loading\u2026</div>` +
      (meta.what_if ? `<h3>What if ${esc(meta.what_if)} <span class="badge ${r[R.what_if] === 1 ? "differs" : "same"}">${r[R.what_if] === 1 ? "differs" : "same"}</span></h3><div class="what-if">loading\u2026</div>` : "") +
      `<p>From a shell: <code>yb explain ${id} --full</code></p>`;
    panel.querySelector(".close").onclick = () => select(-1);
    let loaded;
    try {
      loaded = await decisionTexts();
    } catch (err) {
      panel.querySelector(".decision").textContent = String(err);
      return;
    }
    if (selected !== i) return; // another click came first
    panel.querySelector(".decision").innerHTML = explainBlock(loaded[0][i]);
    if (meta.what_if) panel.querySelector(".what-if").innerHTML = explainBlock(loaded[1][i] || "");
    panel.dataset.loaded = "true";
  }

  function select(i) {
    selected = i;
    selectedPlan = -1;
    delete panel.dataset.plan;
    if (i < 0) {
      panel.hidden = true;
      delete panel.dataset.requestId;
    } else {
      showDecision(i);
    }
    resize(); // the panel takes width from the chart
    draw();
  }

  // Centre the view on a request (its admission to its prefill's end) and scroll its
  // lane into sight.
  function zoomTo(i) {
    const r = requests[i];
    const s = spans[i];
    const a = r[R.admitted];
    const b = Math.max(s.c1, a + 1e-3);
    const pad = (b - a) * 0.6 + 1e-3;
    view.t0 = a - pad;
    view.t1 = b + pad;
    draw();
    const box = boxOf(i);
    const rect = canvas.getBoundingClientRect();
    const header = document.querySelector("header").getBoundingClientRect().height;
    const top = rect.top + window.scrollY + box.y;
    if (top - window.scrollY < header + 10 || top - window.scrollY > window.innerHeight - 40) {
      window.scrollTo(0, Math.max(0, top - header - window.innerHeight / 3));
    }
  }

  // --- interaction ---------------------------------------------------------------
  function zoom(factor, atX) {
    const t = tOf(atX ?? GUTTER + plotWidth() / 2);
    const minSpan = 1e-4;
    const maxSpan = span * 4;
    const next = Math.min(maxSpan, Math.max(minSpan, (view.t1 - view.t0) * factor));
    const f = (t - view.t0) / (view.t1 - view.t0);
    view.t0 = t - f * next;
    view.t1 = view.t0 + next;
    draw();
  }
  function pan(seconds) {
    view.t0 += seconds;
    view.t1 += seconds;
    draw();
  }
  function fit() {
    view.t0 = -span * 0.01;
    view.t1 = span * 1.01;
    draw();
  }

  const localX = (ev) => ev.clientX - canvas.getBoundingClientRect().left;
  const localY = (ev) => ev.clientY - canvas.getBoundingClientRect().top;
  canvas.addEventListener("wheel", (ev) => {
    ev.preventDefault();
    if (ev.shiftKey || Math.abs(ev.deltaX) > Math.abs(ev.deltaY)) {
      pan(((ev.deltaX || ev.deltaY) / plotWidth()) * (view.t1 - view.t0));
    } else {
      zoom(Math.exp(ev.deltaY * 0.002), localX(ev));
    }
  }, { passive: false });
  let drag = null;
  canvas.addEventListener("mousedown", (ev) => {
    drag = { x: ev.clientX, t0: view.t0, t1: view.t1, moved: false };
  });
  window.addEventListener("mousemove", (ev) => {
    if (drag) {
      const dx = ev.clientX - drag.x;
      if (Math.abs(dx) > 3) drag.moved = true;
      if (drag.moved) {
        canvas.classList.add("dragging");
        const dt = (dx / plotWidth()) * (drag.t1 - drag.t0);
        view.t0 = drag.t0 - dt;
        view.t1 = drag.t1 - dt;
        draw();
      }
      return;
    }
    if (ev.target === canvas) tooltip(ev);
  });
  window.addEventListener("mouseup", (ev) => {
    const wasDrag = drag && drag.moved;
    drag = null;
    canvas.classList.remove("dragging");
    if (!wasDrag && ev.target === canvas) {
      const k = hitPlan(localX(ev), localY(ev));
      if (k >= 0) {
        tip.hidden = true;
        selectPlan(k);
        return;
      }
      const i = hit(localX(ev), localY(ev));
      if (i >= 0) {
        tip.hidden = true;
        select(i);
      }
    }
  });
  canvas.addEventListener("dblclick", (ev) => zoom(0.5, localX(ev)));
  canvas.addEventListener("mouseleave", () => { tip.hidden = true; });

  const tip = document.getElementById("yb-tip");
  function tooltip(ev) {
    const k = hitPlan(localX(ev), localY(ev));
    if (k >= 0) {
      const plan = plans[k];
      tip.textContent = `planner at ${secs(plan[P.time])}: ${plan[P.actions].map(actionText).join(", ") || "no action"}\n` +
        `${plan[P.reason]}\n` + plan[P.pools].map(poolText).join("\n");
      tip.hidden = false;
      tip.style.left = Math.min(localX(ev) + 12, width - 420) + "px";
      tip.style.top = localY(ev) + 14 + "px";
      return;
    }
    const i = hit(localX(ev), localY(ev));
    if (i < 0) { tip.hidden = true; return; }
    const r = requests[i];
    tip.textContent = `${r[R.id]}  ${meta.outcomes[r[R.outcome]]}  ${meta.branches[r[R.branch]] || ""}\n` +
      `TTFT est ${secs(r[R.est_ttft])}, measured ${secs(r[R.ttft])}`;
    tip.hidden = false;
    tip.style.left = Math.min(localX(ev) + 12, width - 260) + "px";
    tip.style.top = localY(ev) + 14 + "px";
  }

  document.querySelectorAll("#yb-controls button").forEach((b) => {
    b.addEventListener("click", () => {
      const a = b.dataset.action;
      if (a === "fit") fit(); else zoom(a === "in" ? 0.5 : 2);
    });
  });
  const toggle = (id, key) => {
    const box = document.getElementById(id);
    box.checked = layers[key];
    box.addEventListener("change", () => { layers[key] = box.checked; draw(); });
  };
  toggle("yb-show-queue", "queue");
  toggle("yb-show-transfers", "transfers");
  toggle("yb-show-handoffs", "handoffs");
  toggle("yb-show-changed", "changedOnly");
  document.getElementById("yb-show-changed-label").hidden = !meta.what_if;
  const search = document.getElementById("yb-search");
  search.addEventListener("keydown", (ev) => {
    if (ev.key !== "Enter") return;
    const i = byId.get(search.value.trim());
    search.setCustomValidity(i == null ? "no such request in this window" : "");
    search.reportValidity();
    if (i != null) { select(i); zoomTo(i); }
  });
  window.addEventListener("keydown", (ev) => {
    if (ev.target instanceof HTMLInputElement) return;
    const step = (view.t1 - view.t0) * 0.2;
    if (ev.key === "+" || ev.key === "=") zoom(0.5);
    else if (ev.key === "-") zoom(2);
    else if (ev.key === "ArrowLeft") pan(-step);
    else if (ev.key === "ArrowRight") pan(step);
    else if (ev.key === "f") fit();
    else if (ev.key === "Escape") select(-1);
  });
  window.addEventListener("resize", () => { resize(); draw(); });

  // --- header, legend --------------------------------------------------------------
  document.getElementById("yb-title").textContent = meta.title;
  const origin = meta.wall_clock ? `t0 = ${new Date(meta.t0 * 1000).toISOString()}` : "";
  const counts = {};
  for (const r of requests) {
    const o = meta.outcomes[r[R.outcome]];
    counts[o] = (counts[o] || 0) + 1;
  }
  const outcomeCounts = Object.entries(counts).map(([k, v]) => `${v} ${k}`).join(", ");
  const parts = [
    meta.source, meta.window, `seq ${meta.first_seq}..${meta.last_seq}`,
    `${requests.length} requests (${outcomeCounts})`, `policy ${meta.policy || "?"}`,
    meta.what_if ? `what-if: ${meta.what_if}` : "", origin,
  ].filter(Boolean);
  document.getElementById("yb-meta").innerHTML = parts.map(esc).join(" \u00b7 ") +
    (meta.note ? ` \u00b7 <span class="note">${esc(meta.note)}</span>` : "");
  const swatch = (color, text) => `<span><i style="background:${color}"></i>${esc(text)}</span>`;
  document.getElementById("yb-legend").innerHTML = [
    swatch(BRANCH_COLORS.recompute, "prefill: recompute"),
    swatch(BRANCH_COLORS.local, "prefill: local prefix"),
    swatch(BRANCH_COLORS.transfer, "prefill: pulls a remote prefix"),
    swatch("rgba(102,112,133,.6)", "queue wait (decided \u2192 started)"),
    swatch("#d92d20", "refused / failed / cancelled"),
    swatch("rgba(46,139,87,.5)", "decode batch size"),
    swatch("rgba(224,138,30,.5)", "kvstore pool use; transfer source \u2192 target"),
    swatch("rgba(105,65,198,.7)", "hot-prefix replication"),
    swatch("rgba(23,92,211,.5)", "hand-off prefill \u2192 decode"),
    swatch("rgba(224,138,30,.35)", "instance draining (told to stop)"),
    swatch("rgba(217,45,32,.3)", "instance down"),
    ...(plans.length ? [
      swatch(ACTION_COLORS.add, "planner: add"),
      swatch(ACTION_COLORS.drain, "planner: drain"),
      swatch(ACTION_COLORS.move, "planner: move"),
      swatch(POOL_COLORS.prefill, "prefill serving"),
      swatch(POOL_COLORS.decode, "decode serving"),
    ] : []),
    "<span>drag: pan \u00b7 wheel: zoom \u00b7 click a request: its decision</span>",
  ].join("");

  // --- start ---------------------------------------------------------------------
  // For tests and scripts: where a request is drawn (client coordinates), and ways
  // to reach it. The page draws nothing differently for them.
  window.ybTimeline = {
    requestBox(id) {
      const i = byId.get(id);
      if (i == null) return null;
      const b = boxOf(i);
      const rect = canvas.getBoundingClientRect();
      const x0 = Math.max(b.x, GUTTER);
      const x1 = Math.min(b.x + b.w, width);
      if (x1 <= x0) return null; // out of the view
      return { x: rect.left + x0, y: rect.top + b.y, width: x1 - x0, height: b.h };
    },
    select: (id) => { const i = byId.get(id); if (i != null) select(i); return i != null; },
    zoomTo: (id) => { const i = byId.get(id); if (i != null) zoomTo(i); return i != null; },
    selected: () => (selected >= 0 ? requests[selected][R.id] : null),
    // Planner decisions by index into data.plans.
    planBox(k) {
      if (!plannerRow || k < 0 || k >= plans.length) return null;
      const x = xOf(plans[k][P.time]);
      if (x < GUTTER || x > width) return null;
      const rect = canvas.getBoundingClientRect();
      return { x: rect.left + x, y: rect.top + plannerRow.y, width: 1, height: plannerRow.h };
    },
    selectPlan: (k) => { if (k < 0 || k >= plans.length) return false; selectPlan(k); return true; },
    selectedPlan: () => selectedPlan,
    decisions: () => decisionTexts().then(() => true),
    view: () => ({ t0: view.t0, t1: view.t1 }),
    setView: (t0, t1) => { view.t0 = t0; view.t1 = Math.max(t1, t0 + 1e-4); draw(); },
  };
  resize();
  draw();
  // Two frames: the first paints what draw() put on the canvas, the second runs after
  // it, so the mark is a moment when the timeline is on screen.
  requestAnimationFrame(() => requestAnimationFrame(() => {
    window.__ybTimelineReady = performance.now();
    document.body.dataset.ready = "true";
    // Inflate the decisions while the user looks, so the first click is instant.
    setTimeout(() => decisionTexts().catch(() => {}), 0);
  }));
})();
