// shapegate dashboard: polls /dashboard/feed every second, shows it in tables and (charts.js) charts of the last
// 10 minutes.
'use strict';

(() => {
  const FEED_URL = '/dashboard/feed';
  const POLL_MS = 1000;
  const FETCH_TIMEOUT_MS = 2500;
  const STALE_AFTER_S = 3;
  const PALETTE = ['#4e9bff', '#ffa94d', '#38d9a9', '#f783ac', '#ffd43b', '#b197fc', '#ff6b6b', '#66d9e8'];
  const CLASS_ORDER = ['interactive', 'long_prompt', 'long_output', 'default'];
  const OUTCOMES = ['ok', 'client_left', 'client_error', 'engine_error'];

  const state = {
    colors: new Map(),
    lastOk: null, // {t (client s), feed}
    failure: null, // reason string while the feed is failing
    failingSince: null,
  };

  const $ = (sel) => document.querySelector(sel);
  const nowS = () => Date.now() / 1000;

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v == null) continue;
      if (k === 'class') node.className = v;
      else if (k === 'testid') node.dataset.testid = v;
      else if (k === 'value') node.dataset.value = v;
      // CSSOM, not a style attribute: the page's CSP forbids inline style attributes.
      else if (k === 'color') node.style.background = v;
      else node.setAttribute(k, v);
    }
    for (const c of children) node.append(c instanceof Node ? c : String(c));
    return node;
  }

  function fmt(v) {
    if (v == null || Number.isNaN(v)) return '—';
    if (Number.isInteger(v)) return v.toLocaleString('en-US');
    const a = Math.abs(v);
    if (a >= 1000) return Math.round(v).toLocaleString('en-US');
    if (a >= 100) return v.toFixed(0);
    if (a >= 10) return v.toFixed(1);
    return v.toFixed(2);
  }
  const fmtPct = (rate) => (rate == null ? '—' : `${fmt(rate * 100)}%`);
  const clock = (t) => new Date(t * 1000).toLocaleTimeString('en-GB', { hour12: false });

  function colorOf(id) {
    if (!state.colors.has(id)) state.colors.set(id, PALETTE[state.colors.size % PALETTE.length]);
    return state.colors.get(id);
  }

  // Text plus the raw number in data-value, so a reader (person or test) sees both.
  function num(testid, v, text) {
    return el('span', { testid, value: v == null ? '' : String(v) }, text ?? fmt(v));
  }

  function badge(kind, value, testid) {
    const v = value || 'unknown';
    return el('span', { class: `badge ${kind}-${v}`, testid }, v.replace('_', ' '));
  }

  function fitText(m, predicted) {
    if (!m || m.samples == null) return '—';
    const parts = [];
    if (predicted?.ttft_ms != null) parts.push(`predicts TTFT ${fmt(predicted.ttft_ms)}ms, ITL ${fmt(predicted.itl_ms)}ms now`);
    if (m.ttft_t0_ms != null) parts.push(`t0 ${fmt(m.ttft_t0_ms)}ms`);
    if (m.prefill_tps != null) parts.push(`${fmt(m.prefill_tps)} pf tok/s`);
    if (m.itl_a_ms != null) parts.push(`ITL ${fmt(m.itl_a_ms)}+${fmt(m.itl_b_ms)}·n`);
    parts.push(`n=${m.samples}`);
    return parts.join(' · ');
  }

  function renderBackends(feed) {
    const rows = feed.backends.map((b) => {
      const o = b.overall || {};
      const load = b.load || {};
      const loadCls = load.fresh === false ? 'n old' : 'n';
      const errCls = (o.error_rate ?? 0) >= 0.05 ? 'n bad' : 'n';
      return el('tr', { testid: `backend:${b.id}` },
        el('td', { class: 'id', title: `latency fit: ${fitText(b.model, o.predicted)}` },
          el('i', { class: 'swatch', color: colorOf(b.id) }), b.id, ' ',
          el('small', { class: 'engine', testid: `engine:${b.id}` }, b.engine ?? '')),
        el('td', {}, badge('health', b.health, `health:${b.id}`)),
        el('td', {}, badge('breaker', b.breaker, `breaker:${b.id}`)),
        el('td', { class: 'n' }, num(`table:in_flight:${b.id}`, b.in_flight)),
        el('td', { class: loadCls, title: load.fresh === false ? 'engine load sample is old' : null },
          num(`table:running:${b.id}`, load.running), ' / ', num(`table:waiting:${b.id}`, load.waiting)),
        el('td', { class: loadCls }, num(`table:kv:${b.id}`, load.kv_usage, fmtPct(load.kv_usage))),
        el('td', { class: 'n' }, num(`table:rps:${b.id}`, o.rps)),
        el('td', { class: 'n' }, num(`table:output_tps:${b.id}`, o.output_tps)),
        el('td', { class: errCls }, num(`table:error_rate:${b.id}`, o.error_rate, fmtPct(o.error_rate))),
        ...['ttft', 'itl', 'e2e'].map((m) => el('td', { class: 'n' },
          num(`table:${m}_p50:${b.id}`, o[`${m}_ms`]?.p50), el('span', { class: 'sep' }, ' / '),
          num(`table:${m}_p99:${b.id}`, o[`${m}_ms`]?.p99))));
    });
    if (!rows.length) rows.push(el('tr', {}, el('td', { colspan: 12, class: 'empty' }, 'no backends in the feed')));
    $('[data-testid="backends-body"]').replaceChildren(...rows);
  }

  // Per backend over the window: how each attempt ended, failovers away from it, times its breaker opened.
  function renderOutcomes(feed) {
    const rows = feed.backends.map((b) => {
      const out = b.overall?.outcomes || {};
      return el('tr', { testid: `outcomes:${b.id}` },
        el('td', { class: 'id' }, el('i', { class: 'swatch', color: colorOf(b.id) }), b.id),
        ...OUTCOMES.map((k) => el('td', { class: k === 'engine_error' && out[k] ? 'n bad' : 'n' },
          num(`outcome:${k}:${b.id}`, out[k] ?? null))),
        el('td', { class: 'n' }, num(`failovers:${b.id}`, b.failovers ?? null)),
        el('td', { class: b.breaker_openings ? 'n bad' : 'n' }, num(`breaker_openings:${b.id}`, b.breaker_openings ?? null)));
    });
    if (!rows.length) rows.push(el('tr', {}, el('td', { colspan: 7, class: 'empty' }, 'no backends in the feed')));
    $('[data-testid="outcomes-body"]').replaceChildren(...rows);
  }

  // With replicas sharing a Redis store: one line per replica, this one marked.
  function renderReplicas(feed) {
    const panel = $('[data-testid="replicas"]');
    const list = Array.isArray(feed.replicas) ? feed.replicas : [];
    panel.hidden = !list.length;
    // A row of its own, so that it never narrows the backends table (CSSOM: the CSP forbids style attributes).
    panel.style.gridColumn = '1 / -1';
    const now = feed.now ?? nowS();
    $('[data-testid="replicas-body"]').replaceChildren(...list.map((r) => el('tr', { testid: `replica:${r.replica}` },
      el('td', { class: 'id' }, r.replica, r.self ? ' (this one)' : ''),
      el('td', { class: 'n' }, num(`replica:workers:${r.replica}`, r.workers)),
      el('td', { class: 'n' }, num(`replica:requests:${r.replica}`, r.requests)),
      el('td', { class: 'n' }, num(`replica:rps:${r.replica}`, r.rps)),
      el('td', { class: (r.error_rate ?? 0) >= 0.05 ? 'n bad' : 'n' },
        num(`replica:error_rate:${r.replica}`, r.error_rate, fmtPct(r.error_rate))),
      el('td', { class: 'n' }, num(`replica:rejected:${r.replica}`, r.rejected)),
      el('td', { class: 'n' }, num(`replica:in_flight:${r.replica}`, r.in_flight)),
      el('td', { class: 'n' }, r.taken_at == null ? '—' : `${fmt(Math.max(0, now - r.taken_at))} s`))));
  }

  function classNames(classes) {
    const names = Object.keys(classes || {});
    const rank = (c) => (CLASS_ORDER.includes(c) ? CLASS_ORDER.indexOf(c) : CLASS_ORDER.length);
    return names.sort((a, b) => rank(a) - rank(b) || a.localeCompare(b));
  }

  // Rows are backends (aligned with the backends table), columns are shape classes: a cell is the
  // share of that class's requests the backend served in the window.
  function renderRouting(feed) {
    const names = classNames(feed.classes);
    const head = el('tr', {}, el('th', {}, 'backend'), ...names.map((name) => {
      const c = feed.classes[name] || {};
      return el('th', { class: 'n' }, name, el('br'),
        el('small', {}, num(`route:${name}:requests`, c.requests, c.requests == null ? '—' : `${c.requests} req`),
          ' · ', num(`route:${name}:share`, c.share, fmtPct(c.share))));
    }));
    const rows = feed.backends.map((b) => el('tr', {},
      el('td', { class: 'id' }, el('i', { class: 'swatch', color: colorOf(b.id) }), b.id),
      ...names.map((name) => {
        const per = feed.classes[name]?.backends || {};
        const total = Object.values(per).reduce((s, v) => s + (v || 0), 0);
        const count = per[b.id] || 0;
        const share = total ? count / total : null;
        const cell = el('td', { class: 'n route-cell' },
          num(`route:${name}:${b.id}`, share, share == null ? '—' : `${Math.round(share * 100)}%`),
          el('small', {}, count ? ` ${count}` : ''));
        if (share) {
          cell.style.setProperty('--share', `${Math.round(share * 100)}%`);
          cell.style.setProperty('--tint', colorOf(b.id));
        }
        return cell;
      })));
    if (names.length) {
      // Requests the gateway refused before trying a backend, and why the routed ones went where they did.
      rows.push(el('tr', {}, el('td', { class: 'id' }, 'refused'), ...names.map((name) => {
        const n = feed.classes[name]?.rejected ?? null;
        return el('td', { class: n ? 'n bad' : 'n' }, num(`route:${name}:rejected`, n));
      })));
      rows.push(el('tr', {}, el('td', { class: 'id' }, 'reasons'), ...names.map((name) => {
        const reasons = Object.entries(feed.classes[name]?.reasons || {});
        const cell = el('td', { class: 'n', testid: `reasons:${name}` });
        reasons.forEach(([kind, n], i) => {
          if (i) cell.append(el('br'));
          cell.append(el('small', {}, `${kind} `), num(`reason:${name}:${kind}`, n));
        });
        if (!reasons.length) cell.append('—');
        return cell;
      })));
    } else {
      rows.splice(0, rows.length, el('tr', {}, el('td', { class: 'empty' }, 'no requests in the window')));
    }
    $('[data-testid="routing-head"]').replaceChildren(head);
    $('[data-testid="routing-body"]').replaceChildren(...rows);
  }

  function renderTotals(feed) {
    const t = feed.totals || {};
    const set = (key, v, text) => {
      const node = $(`[data-testid="totals:${key}"]`);
      node.textContent = text ?? fmt(v);
      node.dataset.value = v == null ? '' : String(v);
    };
    set('rps', t.rps);
    set('in_flight', t.in_flight, t.in_flight == null ? '—' : String(t.in_flight));
    set('error_rate', t.error_rate, fmtPct(t.error_rate));
    set('requests', t.requests, t.requests == null ? '—' : String(t.requests));
    set('rejected', t.rejected, t.rejected == null ? '—' : String(t.rejected));
    $('[data-testid="totals:error_rate"]').classList.toggle('bad', (t.error_rate ?? 0) >= 0.05);
    $('[data-testid="totals:rejected"]').classList.toggle('bad', (t.rejected ?? 0) > 0);
    // Requests waiting in the gateway's queue for a seat, and per priority in its title (with how waits ended).
    const q = feed.queue || null;
    set('queued', q?.length, q == null ? '—' : String(q.length));
    $('[data-testid="totals:queued"]').title = Object.entries(q?.priorities || {}).map(([p, row]) =>
      `${p}: ${row.length} waiting; ` + Object.entries(row.ended || {}).map(([o, e]) =>
        `${o} ${e.count} (mean ${fmt(e.mean_wait_s)} s)`).join(', ')).join('\n');
    // Every worker of the process group adds its summary; fewer than expected means one has not reported.
    const w = feed.workers || {};
    const node = $('[data-testid="totals:workers"]');
    node.textContent = w.count == null ? '—' : (w.expected && w.expected !== w.count ? `${w.count} of ${w.expected}` : String(w.count));
    node.dataset.value = w.count == null ? '' : String(w.count);
    node.classList.toggle('bad', w.expected != null && w.count !== w.expected);
    node.title = (w.summaries || []).map((s) => `worker ${s.worker}: summary ${fmt(s.age_s)} s old`).join('\n');
    const span = feed.window_s != null ? `last ${feed.window_s} s` : '';
    for (const n of document.querySelectorAll('.window, .window-note')) n.textContent = span;
  }

  function renderStatus() {
    const now = nowS();
    const age = state.lastOk ? now - state.lastOk.t : null;
    const stale = state.failure != null || age == null || age > STALE_AFTER_S;
    document.documentElement.dataset.feed = state.lastOk == null && state.failure == null ? 'loading' : stale ? 'stale' : 'live';
    $('[data-testid="last-update-ago"]').textContent = age == null ? '' : `(${Math.max(0, Math.round(age))} s ago)`;
    const banner = $('[data-testid="stale"]');
    banner.hidden = !stale || (state.lastOk == null && state.failure == null);
    if (!banner.hidden) {
      const since = state.failingSince ? ` since ${clock(state.failingSince)}` : '';
      const why = state.failure ?? 'no answer yet';
      const from = state.lastOk ? `Numbers shown are from ${clock(state.lastOk.feed.now ?? state.lastOk.t)}, ${Math.round(age)} s old.` : 'No data received yet.';
      banner.textContent = `STALE: feed failing${since} (${why}). ${from}`;
    }
    charts.draw(now);
  }

  function apply(feed) {
    const t = nowS();
    feed.backends = Array.isArray(feed.backends) ? feed.backends : [];
    const recovered = state.failure != null && state.lastOk != null;
    state.lastOk = { t, feed };
    state.failure = null;
    state.failingSince = null;
    for (const b of feed.backends) colorOf(b.id);
    charts.record(feed, t);
    if (recovered) charts.load().then(renderStatus); // the gateway kept the figures this page missed
    renderTotals(feed);
    renderBackends(feed);
    renderOutcomes(feed);
    renderRouting(feed);
    renderReplicas(feed);
    charts.legends(feed);
    const stamp = $('[data-testid="last-update"]');
    stamp.textContent = clock(feed.now ?? t);
    stamp.dataset.value = String(feed.now ?? t);
  }

  function fail(reason) {
    if (state.failure == null) state.failingSince = nowS();
    state.failure = reason;
  }

  async function poll() {
    const started = performance.now();
    const ctrl = new AbortController();
    const timer = setTimeout(() => ctrl.abort(), FETCH_TIMEOUT_MS);
    try {
      const r = await fetch(FEED_URL, { credentials: 'same-origin', cache: 'no-store', signal: ctrl.signal, headers: { Accept: 'application/json' } });
      if (r.status === 401) fail('session expired or signed out: reload to sign in');
      else if (!r.ok) fail(`feed answered HTTP ${r.status}`);
      else apply(await r.json());
    } catch (e) {
      fail(e.name === 'AbortError' ? 'feed timed out' : 'gateway unreachable');
    } finally {
      clearTimeout(timer);
    }
    renderStatus();
    setTimeout(poll, Math.max(0, POLL_MS - (performance.now() - started)));
  }

  // The experiments section (experiments.js, loaded after this file) builds its DOM with the same helpers.
  window.shapegateDashboard = Object.freeze({ el, fmt, fmtPct, clock, num, badge });
  // charts.js, loaded before this file: the charts and the history that fills them as the page opens.
  const charts = window.shapegateCharts({ el, fmt, num, colorOf, colors: state.colors, root: $('[data-testid="charts"]') });

  // Charts and the age counter keep moving while a fetch hangs, so staleness is always visible.
  setInterval(renderStatus, POLL_MS);
  window.addEventListener('resize', renderStatus);
  charts.load().then(renderStatus);
  poll();
})();
