// shapegate dashboard: the usage section, from /dashboard/usage (the usage ledger over days, by day and by key).
'use strict';

(() => {
  const USAGE_URL = '/dashboard/usage';
  // The ledger is flushed about once a second and read by hours: a minute between refreshes is plenty.
  const POLL_MS = 60000;
  const FETCH_TIMEOUT_MS = 8000;
  const { el, fmt, clock, num } = window.shapegateDashboard;
  const $ = (sel) => document.querySelector(sel);
  let days = 7;
  let timer = null;
  let shownAt = null;

  const COLUMNS = [
    ['requests', 'requests'], ['prompt_tokens', 'prompt'], ['cached_tokens', 'cached'],
    ['completion_tokens', 'output'], ['errors', 'errors', true], ['refused', 'refused', true],
  ];

  function cost(v, report) {
    return v == null ? '' : `${v.toFixed(v >= 100 ? 0 : 2)} ${report.currency}`;
  }

  function cells(r, id, report) {
    const out = COLUMNS.map(([name, testid, bad]) => el('td', { class: bad && r[name] ? 'n bad' : 'n' },
      num(`usage-${testid}:${id}`, r[name] ?? 0)));
    if (report.priced) out.push(el('td', { class: 'n' }, num(`usage-cost:${id}`, r.cost, cost(r.cost, report))));
    out.push(el('td', { class: 'n muted' }, num(`usage-shadow:${id}`, r.shadow_requests ?? 0)));
    return out;
  }

  function table(body, rows, label, report, empty) {
    const trs = rows.map((r) => el('tr', { testid: `usage-row:${r[label]}` },
      el('td', { class: 'id' }, r[label]), ...cells(r, r[label], report)));
    if (!trs.length) trs.push(el('tr', {}, el('td', { colspan: 9, class: 'empty' }, empty)));
    $(body).replaceChildren(...trs);
  }

  function render(report) {
    shownAt = Date.now() / 1000;
    $('[data-testid="usage-at"]').textContent = clock(shownAt);
    const where = report.store === 'redis' ? 'every replica on the Redis store' : 'this process only';
    $('[data-testid="usage-scope"]').textContent =
      `last ${report.days} day${report.days > 1 ? 's' : ''} · ${where} · kept ${report.retention_days} days` +
      (report.unpriced_models?.length ? ` · no price for ${report.unpriced_models.join(', ')}` : '');
    for (const th of document.querySelectorAll('.usage .cost')) th.hidden = !report.priced;
    table('[data-testid="usage-days"]', report.by_day || [], 'day', report, 'no usage in this range');
    table('[data-testid="usage-keys"]', report.by_key || [], 'key', report, 'no usage in this range');
    const t = report.totals || {};
    $('[data-testid="usage-total"]').replaceChildren(el('td', { class: 'id' }, 'total'), ...cells(t, 'total', report));
    $('[data-testid="usage-failing"]').textContent = '';
  }

  function failed(why) {
    const since = shownAt == null ? '' : `; shown as of ${clock(shownAt)}`;
    $('[data-testid="usage-failing"]').textContent = `· refresh failing (${why})${since}`;
  }

  async function poll() {
    clearTimeout(timer);
    const ctrl = new AbortController();
    const abort = setTimeout(() => ctrl.abort(), FETCH_TIMEOUT_MS);
    try {
      const r = await fetch(`${USAGE_URL}?days=${days}`, { credentials: 'same-origin', cache: 'no-store',
        signal: ctrl.signal, headers: { Accept: 'application/json' } });
      if (r.ok) render(await r.json());
      else if (r.status === 404) $('[data-testid="usage"]').hidden = true; // the ledger is off
      else failed(`HTTP ${r.status}`);
    } catch (e) {
      failed(e.name === 'AbortError' ? 'timed out' : e instanceof SyntaxError ? 'not JSON' : 'gateway unreachable');
    } finally {
      clearTimeout(abort);
    }
    timer = setTimeout(poll, POLL_MS);
  }

  for (const b of document.querySelectorAll('[data-usage-days]')) {
    b.addEventListener('click', () => {
      days = Number(b.dataset.usageDays);
      for (const o of document.querySelectorAll('[data-usage-days]')) o.setAttribute('aria-pressed', String(o === b));
      poll();
    });
  }
  poll();
})();
