// shapegate dashboard: the A/B experiments section, from /admin/experiments (the sign-in cookie authorises it).
'use strict';

(() => {
  const REPORT_URL = '/admin/experiments';
  // Every report reruns the bootstraps behind the verdicts (the gateway caches one for 2 s): a few seconds apart.
  const POLL_MS = 5000;
  const FETCH_TIMEOUT_MS = 4000;
  const CLASS_ORDER = ['all', 'interactive', 'long_prompt', 'long_output', 'default'];
  const DECIDED = new Set(['a_better', 'b_better']);
  const AGREEMENT_NOTE = 'temperature-0 copies whose output matched the primary\'s exactly; ' +
    'prefix: the median share of the primary\'s output matched before the first difference';
  const SHADOW_HEADS = ['copies sent', 'copies skipped', 'copy errors', 'output agreement'];
  const { el, fmt, fmtPct, clock, num, badge } = window.shapegateDashboard;

  const $ = (sel) => document.querySelector(sel);
  let shownAt = null; // generated_at of the report on screen

  // Sort key, smaller first: differences (the CI furthest from "no change" first), then "not distinguishable",
  // then the ones waiting for data (the closest to a verdict first).
  function decisiveness(c) {
    if (DECIDED.has(c.verdict)) {
      const near = c.ci_low > 0 ? Math.min(Math.abs(Math.log(c.ci_low)), Math.abs(Math.log(c.ci_high))) : Infinity;
      return [0, -near];
    }
    return [c.verdict === 'no_difference' ? 1 : 2, c.needed ?? Infinity];
  }

  const byDecisiveness = (p, q) => {
    const [a, b] = [decisiveness(p), decisiveness(q)];
    return a[0] - b[0] || a[1] - b[1];
  };

  function classRank(name) {
    const i = CLASS_ORDER.indexOf(name);
    return i < 0 ? CLASS_ORDER.length : i;
  }

  function figures(c) {
    const [a, b] = c.arms;
    const n = c.n || {};
    const of = c.stat && c.stat !== 'mean' ? `${c.stat}s` : 'means';
    return `${b} / ${a} (${of}): ratio ${fmt(c.ratio)} (95% CI ${fmt(c.ci_low)}–${fmt(c.ci_high)}), ` +
      `noise floor ${fmtPct(c.noise_floor)}, margin ${fmtPct(c.margin)}, ${c.better_is} is better; ` +
      `n ${a} ${n[a] ?? 0}, ${b} ${n[b] ?? 0}`;
  }

  // The median's and the tail's verdicts, under the mean's (the same samples).
  function quantiles(x, klass, c) {
    const qs = Object.values(c.quantiles || {});
    if (!qs.length) return [];
    return [el('div', { class: 'quantiles' }, ...qs.map((q) => el('div', {
      class: `v-${q.verdict}`, title: figures(q), value: q.verdict,
      testid: `verdict:${x.name}:${klass}:${q.metric}:${q.arms[1]}:${q.stat}`,
    }, q.summary)))];
  }

  function renderVerdicts(x) {
    const groups = new Map();
    for (const c of x.comparisons || []) {
      if (!groups.has(c.class)) groups.set(c.class, []);
      groups.get(c.class).push(c);
    }
    const names = [...groups.keys()].sort((a, b) => classRank(a) - classRank(b) || a.localeCompare(b));
    if (!names.length) return el('p', { class: 'empty' }, 'no requests yet: nothing to compare');
    return el('div', { class: 'verdicts' }, ...names.map((name) => el('div', { testid: `verdicts:${x.name}:${name}` },
      el('h4', {}, name),
      el('ul', {}, ...groups.get(name).sort(byDecisiveness).map((c) => el('li', {
        class: `v-${c.verdict}`, value: c.verdict,
      }, el('span', {
        title: figures(c), value: c.verdict, testid: `verdict:${x.name}:${name}:${c.metric}:${c.arms[1]}`,
      }, c.summary), ...quantiles(x, name, c)))))));
  }

  // An arm the error guard stopped: why, since when, how to resume it (on the command line or the admin API).
  function guarded(x) {
    const lines = (x.arms || []).filter((a) => a.guard).map((a) => {
      const g = a.guard;
      const where = (x.processes ?? 1) > 1 ? ` on ${g.processes} of ${x.processes} processes` : '';
      return el('p', { class: 'guard', testid: `guard:${x.name}:${a.name}`, value: g.at },
        `arm ${a.name} stopped by the error guard${where} since ${clock(g.at)}: ${g.reason}. `,
        el('small', {}, `shapegate ab start ${x.name} resumes it`));
    });
    return lines.length ? [el('div', { class: 'guards' }, ...lines)] : [];
  }

  // Copies sent to a shadow arm, those skipped (the arm busy or unhealthy), and whether it says what the primary said.
  function shadowCells(x, a) {
    const s = a.shadow;
    if (!s) return [el('td', { colspan: 4, class: 'empty' }, a.share == null ? 'serves the model' : '')];
    const ag = s.agreement || {};
    const prefix = ag.common_prefix_share?.p50;
    const tokens = ag.common_prefix_tokens?.p50;
    const skipped = (s.skipped_busy ?? 0) + (s.skipped_unhealthy ?? 0);
    return [
      el('td', { class: 'n' }, num(`shadow-sent:${x.name}:${a.name}`, s.sent ?? 0),
        el('small', {}, s.in_flight ? ` (${s.in_flight} in flight)` : '')),
      el('td', { class: 'n' }, num(`shadow-skipped:${x.name}:${a.name}`, skipped),
        el('small', {}, skipped ? ` (busy ${s.skipped_busy ?? 0} · unhealthy ${s.skipped_unhealthy ?? 0})` : '')),
      el('td', { class: s.engine_error ? 'n bad' : 'n' },
        num(`shadow-errors:${x.name}:${a.name}`, s.engine_error ?? 0)),
      el('td', { class: 'n', title: AGREEMENT_NOTE },
        num(`agreement:${x.name}:${a.name}`, ag.exact_rate ?? null,
          ag.compared ? `${ag.exact} of ${ag.compared} identical (${fmtPct(ag.exact_rate)})` : 'none compared'),
        el('small', {}, prefix == null ? '' : ` · prefix p50 ${fmtPct(prefix)}`,
          tokens == null ? '' : ` (${fmt(tokens)} tok)`)),
    ];
  }

  function renderArms(x) {
    const shadow = x.mode === 'shadow';
    const head = el('tr', {}, el('th', {}, 'arm'), el('th', {}, 'backends'), el('th', { class: 'n' }, 'share'),
      el('th', { class: 'n' }, 'requests'), el('th', { class: 'n' }, 'engine errors'),
      ...(shadow ? SHADOW_HEADS.map((t) => el('th', { class: 'n' }, t)) : []));
    const rows = (x.arms || []).map((a) => {
      const every = a.classes?.all || {};
      return el('tr', { testid: `arm:${x.name}:${a.name}` },
        el('td', { class: 'id' }, a.name, a.guard ? badge('guard', 'stopped', `arm-guard:${x.name}:${a.name}`) : ''),
        el('td', {}, a.backends ? a.backends.join(', ') : el('small', { class: 'engine' }, 'its usual backends')),
        el('td', { class: 'n' },
          num(`arm-share:${x.name}:${a.name}`, a.share, a.share == null ? '—' : fmtPct(a.share))),
        el('td', { class: 'n' }, num(`arm-requests:${x.name}:${a.name}`, every.requests ?? 0)),
        el('td', { class: every.errors ? 'n bad' : 'n' }, num(`arm-errors:${x.name}:${a.name}`, every.errors ?? 0)),
        ...(shadow ? shadowCells(x, a) : []));
    });
    return el('table', {}, el('thead', {}, head), el('tbody', {}, ...rows));
  }

  function renderExperiment(x) {
    const how = x.mode === 'shadow' ? `shadow, copies of ${fmtPct(x.fraction)} of requests` : x.mode;
    // toPrecision: 0.05 * 100 is 5.000000000000001 in floating point, shown as 5.
    const under = +(x.practical_margin * 100).toPrecision(3);
    const margin = x.practical_margin == null ? '' : ` · differences under ${under}% are none`;
    return el('article', { class: 'experiment', testid: `experiment:${x.name}` },
      el('h3', {}, x.name, ' ', badge('experiment', x.enabled ? 'running' : 'stopped', `experiment-state:${x.name}`),
        el('small', {}, ` model ${x.model} · ${how} · subject ${x.subject}${margin}`)),
      renderArms(x), ...guarded(x), renderVerdicts(x));
  }

  function render(report) {
    const list = Array.isArray(report.data) ? report.data : [];
    shownAt = report.generated_at ?? Date.now() / 1000;
    $('[data-testid="experiments"]').hidden = !list.length;
    const stamp = $('[data-testid="experiments-at"]');
    stamp.textContent = clock(shownAt);
    stamp.dataset.value = String(shownAt);
    $('[data-testid="experiments-failing"]').textContent = '';
    $('[data-testid="experiments-body"]').replaceChildren(...list.map(renderExperiment));
  }

  // The verdicts on screen stay (they change slowly); the note says they are not being refreshed.
  function failed(why) {
    const since = shownAt == null ? '' : `; shown as of ${clock(shownAt)}`;
    $('[data-testid="experiments-failing"]').textContent = `· refresh failing (${why})${since}`;
  }

  async function poll() {
    const ctrl = new AbortController();
    const timer = setTimeout(() => ctrl.abort(), FETCH_TIMEOUT_MS);
    try {
      const r = await fetch(REPORT_URL, { credentials: 'same-origin', cache: 'no-store', signal: ctrl.signal,
        headers: { Accept: 'application/json' } });
      if (r.ok) render(await r.json());
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
