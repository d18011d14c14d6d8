// shapegate dashboard: the charts of the last 10 minutes per backend, filled from the gateway's own record of them
// (/dashboard/history) as the page opens, then from each feed the page polls.
'use strict';

// A factory, so that dashboard.js hands in its DOM helpers and backend colours (this file is loaded first).
window.shapegateCharts = ({ el, fmt, num, colorOf, colors, root }) => {
  const HISTORY_URL = '/dashboard/history';
  const HISTORY_S = 600; // what the gateway keeps (gateway/dashboard/history.py SPAN_S)
  // The time axis grows with the history held (in 30 s steps) up to HISTORY_S, so a page opened a
  // moment ago shows its few seconds across the chart rather than squeezed against its right edge.
  const SPAN_STEP_S = 30;
  // A missing poll longer than this is drawn as a gap, so an outage is visible in every chart.
  const GAP_S = 3.5;

  // Ids as in the gateway's history (gateway/dashboard/history.py FIELDS); `scale` turns the feed's figure into the
  // chart's unit.
  const CHARTS = [
    { id: 'ttft_p50', title: 'TTFT p50', unit: 'ms', get: (b) => b.overall?.ttft_ms?.p50 },
    { id: 'ttft_p99', title: 'TTFT p99', unit: 'ms', get: (b) => b.overall?.ttft_ms?.p99 },
    { id: 'itl_p50', title: 'ITL p50', unit: 'ms', get: (b) => b.overall?.itl_ms?.p50 },
    { id: 'output_tps', title: 'Throughput', unit: 'out tok/s', get: (b) => b.overall?.output_tps },
    { id: 'rps', title: 'Requests', unit: 'req/s', get: (b) => b.overall?.rps },
    // The engine's own failures only: a client that left or sent a bad request is not the engine's error.
    { id: 'error_rate', title: 'Engine error rate', unit: '%', cap: 100, scale: 100, get: (b) => b.overall?.error_rate },
    { id: 'waiting', title: 'Queue waiting', unit: 'requests', get: (b) => b.load?.waiting },
    { id: 'in_flight', title: 'In flight', unit: 'requests', get: (b) => b.in_flight },
  ];

  const state = {
    history: [], // [{t (the gateway's clock), values: {backendId: {chartId: number|null}}}]
    offset: 0, // the gateway's clock minus this browser's, as of the last feed (the charts run on the gateway's)
    fed: false, // a feed came: its clock, not the history's, sets the offset
  };

  function build() {
    for (const spec of CHARTS) {
      spec.canvas = el('canvas', { 'aria-label': `${spec.title} per backend, last 10 minutes`, role: 'img' });
      spec.legend = el('ul', { class: 'legend' });
      root.append(el('figure', { class: 'chart', testid: `chart:${spec.id}` },
        el('figcaption', {}, spec.title, el('span', { class: 'unit' }, spec.unit)), spec.legend, spec.canvas));
    }
  }

  // A backend's figure in the chart's unit, or null.
  function figure(spec, b) {
    const v = spec.get(b);
    return v == null ? null : v * (spec.scale ?? 1);
  }

  function legends(feed) {
    for (const spec of CHARTS) {
      spec.legend.replaceChildren(...feed.backends.map((b) => {
        const v = figure(spec, b);
        return el('li', {}, el('i', { class: 'swatch', color: colorOf(b.id) }), `${b.id} `,
          el('b', {}, num(`${spec.id}:${b.id}`, v ?? null)));
      }));
    }
  }

  // A feed as the newest point, at the gateway's time (`t`: this browser's when it came).
  function record(feed, t) {
    if (typeof feed.now === 'number') state.offset = feed.now - t;
    state.fed = true;
    t += state.offset;
    const values = {};
    for (const b of feed.backends) {
      values[b.id] = {};
      for (const spec of CHARTS) values[b.id][spec.id] = figure(spec, b);
    }
    const last = state.history[state.history.length - 1];
    if (last && t <= last.t) return; // already there (the gateway's history holds this moment)
    state.history.push({ t, values });
    while (state.history.length && state.history[0].t < t - HISTORY_S) state.history.shift();
  }

  // The gateway's record of the last HISTORY_S (columns, one value per field and point) as history points; those
  // this page polled since it asked come after them.
  function applyHistory(h) {
    const times = Array.isArray(h.t) ? h.t : [];
    const series = h.backends || {};
    for (const id of Object.keys(series)) colorOf(id);
    if (!state.fed && typeof h.now === 'number') state.offset = h.now - Date.now() / 1000; // until a feed says
    const points = times.map((t, i) => {
      const values = {};
      for (const [id, fields] of Object.entries(series)) {
        values[id] = {};
        for (const spec of CHARTS) {
          const v = fields[spec.id]?.[i];
          values[id][spec.id] = v == null ? null : v * (spec.scale ?? 1);
        }
      }
      return { t, values };
    });
    const since = points.length ? points[points.length - 1].t : -Infinity;
    state.history = [...points, ...state.history.filter((p) => p.t > since)];
    root.dataset.history = String(points.length); // the points the gateway had, and since when
    root.dataset.historyFrom = points.length ? String(points[0].t) : '';
  }

  // Once as the page opens, and again after the feed comes back from failing (to fill the gap it left).
  async function load() {
    try {
      const r = await fetch(HISTORY_URL, { credentials: 'same-origin', cache: 'no-store', headers: { Accept: 'application/json' } });
      if (r.ok) applyHistory(await r.json());
    } catch (e) {
      // The charts fill from the live feed alone; the feed's own banner says when the gateway is unreachable.
    }
  }

  function niceCeil(v) {
    if (!(v > 0)) return 1;
    const p = 10 ** Math.floor(Math.log10(v));
    for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
    return 10 * p;
  }

  function drawChart(spec, now) {
    const cv = spec.canvas;
    const dpr = window.devicePixelRatio || 1;
    const w = cv.clientWidth;
    const h = cv.clientHeight;
    if (!w || !h) return;
    if (cv.width !== Math.round(w * dpr) || cv.height !== Math.round(h * dpr)) {
      cv.width = Math.round(w * dpr);
      cv.height = Math.round(h * dpr);
    }
    const g = cv.getContext('2d');
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    const L = 46, R = 8, T = 6, B = 18;
    const pw = w - L - R, ph = h - T - B;
    let max = 0;
    for (const s of state.history) for (const id in s.values) max = Math.max(max, s.values[id][spec.id] ?? 0);
    const top = Math.min(spec.cap ?? Infinity, niceCeil(max * 1.1));
    const held = state.history.length ? now - state.history[0].t : 0;
    const span = Math.min(HISTORY_S, Math.max(SPAN_STEP_S, Math.ceil(held / SPAN_STEP_S) * SPAN_STEP_S));
    const x = (t) => L + ((t - (now - span)) / span) * pw;
    const y = (v) => T + ph - (v / top) * ph;
    g.font = '11px system-ui, sans-serif';
    g.fillStyle = '#8b95a7';
    g.strokeStyle = '#2a3140';
    g.lineWidth = 1;
    g.textAlign = 'right';
    g.textBaseline = 'middle';
    for (const f of [0, 0.5, 1]) {
      const yy = Math.round(y(top * f)) + 0.5;
      g.beginPath(); g.moveTo(L, yy); g.lineTo(L + pw, yy); g.stroke();
      g.fillText(fmt(top * f), L - 5, yy);
    }
    g.textAlign = 'center';
    g.textBaseline = 'alphabetic';
    const step = [5, 10, 15, 30, 60, 120].find((s) => span / s <= 6) ?? 120;
    for (let k = Math.floor(span / step); k >= 0; k--) {
      const ago = k * step;
      const label = !ago ? 'now' : ago % 60 ? `-${ago}s` : `-${ago / 60}m`;
      g.fillText(label, Math.min(x(now - ago), L + pw - 12), h - 4);
    }
    for (const [id, color] of colors) {
      g.strokeStyle = g.fillStyle = color;
      g.lineWidth = 1.8;
      g.beginPath();
      let prev = null;
      let last = null;
      for (const s of state.history) {
        const v = s.values[id]?.[spec.id];
        if (v == null) { prev = null; continue; }
        const px = x(s.t), py = y(v);
        if (prev && s.t - prev <= GAP_S) g.lineTo(px, py); else g.moveTo(px, py);
        prev = s.t;
        last = [px, py];
      }
      g.stroke();
      if (last) { g.beginPath(); g.arc(last[0], last[1], 2.5, 0, 2 * Math.PI); g.fill(); }
    }
    // For a reader (person or test): how many moments the chart has a value for.
    cv.parentElement.dataset.points = String(state.history.filter((s) => Object.values(s.values)
      .some((v) => v[spec.id] != null)).length);
  }

  build();
  return Object.freeze({
    record,
    legends,
    load,
    // `now`: this browser's clock; the charts' axis ends at the gateway's time now.
    draw: (now) => { for (const spec of CHARTS) drawChart(spec, now + state.offset); },
  });
};
