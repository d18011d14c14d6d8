// shapegate dashboard: the keys section, from /dashboard/keys (ids, admin flag, limits, token quotas and what they
// used, last use, usage in the window).
'use strict';

(() => {
  const KEYS_URL = '/dashboard/keys';
  // Last use and the window's counts change by the second, but nobody reads a key's line that fast.
  const POLL_MS = 5000;
  const FETCH_TIMEOUT_MS = 4000;
  const SOURCES = {
    config: 'config file',
    runtime: 'run-time',
    unlisted: 'no such key now', // revoked within the window
    anonymous: 'API-key auth is off',
    other: 'more busy keys than are counted apart',
  };
  const { el, fmt, clock, num } = window.shapegateDashboard;

  const $ = (sel) => document.querySelector(sel);
  let shownAt = null; // `now` of the report on screen

  function rateText(r, what) {
    const parts = [];
    if (r?.rpm != null) parts.push(`${fmt(r.rpm)} req/min`);
    if (r?.tpm != null) parts.push(`${fmt(r.tpm)} tok/min`);
    return parts.length ? `${what}${parts.join(', ')}` : '';
  }

  // A key's own limits, or the [limits] defaults it falls back on; per model after the key's own.
  function limitsText(own, defaults) {
    const l = own ?? defaults ?? {};
    const parts = [rateText(l, ''), ...Object.entries(l.models || {}).map(([m, r]) => rateText(r, `${m}: `))]
      .filter(Boolean);
    if (!parts.length) return 'none';
    return parts.join(' · ') + (own == null ? ' (defaults)' : '');
  }

  // Each token quota with what it used this day or month: "tok/day 1,200 of 100,000 used (m)".
  function quotasText(quotas) {
    return (Array.isArray(quotas) ? quotas : []).map((q) =>
      `tok/${q.period} ${fmt(q.used)} of ${fmt(q.limit)} used${q.model ? ` (${q.model})` : ''}`).join(' · ');
  }

  function ago(t, now) {
    if (t == null) return 'never';
    const s = Math.max(0, now - t);
    if (s < 90) return `${Math.round(s)} s ago`;
    if (s < 90 * 60) return `${Math.round(s / 60)} min ago`;
    if (s < 36 * 3600) return `${Math.round(s / 3600)} h ago`;
    return `${Math.round(s / 86400)} d ago`;
  }

  function row(k, report) {
    const u = k.usage || {};
    const listed = k.source === 'config' || k.source === 'runtime';
    const count = (name, testid, bad) => el('td', { class: bad && u[name] ? 'n bad' : 'n' },
      num(`${testid}:${k.id}`, u[name] ?? 0));
    return el('tr', { testid: `key:${k.id}` },
      el('td', { class: 'id' }, k.id, ' ', el('small', { class: 'engine', testid: `key-source:${k.id}` },
        SOURCES[k.source] ?? k.source)),
      el('td', {}, k.admin ? el('span', { class: 'badge key-admin', testid: `key-admin:${k.id}` }, 'admin')
        : el('span', { testid: `key-admin:${k.id}` }, listed ? '—' : '')),
      el('td', { class: 'limits', testid: `key-limits:${k.id}` }, listed ? limitsText(k.limits, report.defaults) : '',
        listed && k.quotas?.length ? el('div', { testid: `key-quotas:${k.id}` }, quotasText(k.quotas)) : ''),
      el('td', { title: k.last_used == null ? null : new Date(k.last_used * 1000).toString() },
        num(`key-last-used:${k.id}`, k.last_used, listed ? ago(k.last_used, report.now) : '—')),
      count('requests', 'key-requests'),
      count('engine_errors', 'key-errors', true),
      count('refused', 'key-refused', true),
      count('prompt_tokens', 'key-prompt'),
      count('completion_tokens', 'key-output'));
  }

  function scopeText(r) {
    const who = r.workers > 1 || r.expected_workers > 1
      ? `${r.workers} of ${r.expected_workers} workers, merged` : 'this process';
    return `usage in the last ${fmt(r.window_s)} s (${who})`;
  }

  function render(report) {
    const keys = Array.isArray(report.keys) ? report.keys : [];
    shownAt = report.now ?? Date.now() / 1000;
    const stamp = $('[data-testid="keys-at"]');
    stamp.textContent = clock(shownAt);
    stamp.dataset.value = String(shownAt);
    $('[data-testid="keys-scope"]').textContent = scopeText(report) +
      (report.auth === false ? ' · API-key auth is off: every request counts as anonymous' : '') +
      (report.stats === false ? ' · [stats] enabled = false: no usage is counted' : '');
    $('[data-testid="keys-failing"]').textContent = '';
    const rows = keys.map((k) => row(k, report));
    if (!rows.length) rows.push(el('tr', {}, el('td', { colspan: 9, class: 'empty' }, 'no keys')));
    $('[data-testid="keys-body"]').replaceChildren(...rows);
    const more = $('[data-testid="keys-more"]');
    more.hidden = !(report.total > keys.length);
    more.textContent = more.hidden ? '' : `${report.total - keys.length} more keys, less used, not shown`;
  }

  function failed(why) {
    const since = shownAt == null ? '' : `; shown as of ${clock(shownAt)}`;
    $('[data-testid="keys-failing"]').textContent = `· refresh failing (${why})${since}`;
  }

  async function poll() {
    const ctrl = new AbortController();
    const timer = setTimeout(() => ctrl.abort(), FETCH_TIMEOUT_MS);
    try {
      const r = await fetch(KEYS_URL, { credentials: 'same-origin', cache: 'no-store', signal: ctrl.signal,
        headers: { Accept: 'application/json' } });
      if (r.ok) render(await r.json());
      else if (r.status === 404) $('[data-testid="keys"]').hidden = true; // a host that keeps no keys view
      else failed(`HTTP ${r.status}`);
    } catch (e) {
      failed(e.name === 'AbortError' ? 'timed out' : e instanceof SyntaxError ? 'not JSON' : 'gateway unreachable');
    } finally {
      clearTimeout(timer);
    }
    setTimeout(poll, POLL_MS);
  }

  poll();
})();
