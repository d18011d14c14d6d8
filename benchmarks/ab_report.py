"""benchmarks/results/ab.md from the runs of benchmarks/ab.py: every sentence computed from the data."""

from __future__ import annotations

from benchmarks import kit

# What the MI350X profiles say (gateway/sim/profiles/mi350x.toml): SGLang's TTFT is higher (40 vs 17 ms at
# c=1), its ITL lower (4.3 vs 4.7 ms per token at c=1). Arm a is vLLM, arm b SGLang.
EXPECTED = {"ttft": "a_better", "itl": "b_better"}
CLASSES = ("all", "long_output", "long_prompt", "default", "interactive")
METRICS = ("ttft", "itl", "e2e", "output_tps", "error_rate")


def _client_ratio(records: list[dict], metric: str, a: str, b: str) -> float | None:
    """The client's own figure, arm b over arm a (medians): a check that does not read the gateway's numbers."""
    med = {arm: kit.median_or_none([r[metric] for r in records if r.get("ok") and r.get("backend") == arm
                         and r.get(metric) is not None]) for arm in (a, b)}
    return med[b] / med[a] if med[a] and med[b] else None


def _fmt(v: float | None, digits: int = 3) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def _comparisons(run: dict) -> list[dict]:
    return [c for c in run["experiment"]["comparisons"] if c["class"] in CLASSES]


def _cells(c: dict) -> str:
    """A comparison's table row up to its verdict."""
    a, b = c["arms"]
    return (f"| {c['class']} | {c['metric']} | {c['n'][a]} / {c['n'][b]} | {_fmt(c['ratio'])} "
            f"[{_fmt(c['ci_low'])}, {_fmt(c['ci_high'])}] | {_fmt(c['noise_floor'])} | {c['verdict']} |")


def _late_share(run: dict) -> float:
    """The largest share of late steps of the run's simulated engines: how far they strayed from their profiles."""
    return max((h["late_steps"] / max(h["steps"], 1) for h in (run.get("sim_health") or {}).values()), default=0.0)


def _late(run: dict) -> str:
    parts = []
    for bid, h in (run.get("sim_health") or {}).items():
        share = h["late_steps"] / max(h["steps"], 1)
        parts.append(f"{bid} {share:.1%} of {h['steps']} steps late")
    return "; ".join(parts) or "not read"


def markdown(meta: dict, runs: list[dict]) -> str:
    split = [r for r in runs if r["mode"] == "split"]
    shadow = [r for r in runs if r["mode"] == "shadow"]
    kinds = ", ".join(f"{name} ({p} prompt / {o} output tokens, {rate}/s)" for name, p, o, rate in meta["kinds"])
    out = ["# A/B testing engines on live traffic: simulated MI350X vLLM vs SGLang", "",
           f"Commit {meta['commit']}{' (with uncommitted changes)' if meta['dirty'] else ''}, {meta['date']}, "
           f"{meta['machine']}; load average before {meta['load_before'][0]:.2f}, after "
           f"{meta['load_after'][0]:.2f}; {meta['elapsed_s']:.0f} s in all. Command: `{meta['command']}`.", "",
           f"Each run: the two simulated engines in one process, the gateway in another, {meta['window_s']:.0f} s of "
           f"Poisson arrivals of {kinds}, all streamed at temperature 0, from {meta['users']} users (the split's "
           f"subject, named in a header). {len(split)} split run(s) and {len(shadow)} shadow run(s), each with fresh engines and "
           "gateway. The verdicts below are the gateway's own (`GET /admin/experiments`); the client column is the "
           "load generator's own median ratio (SGLang / vLLM) over the same requests, a check that reads none of "
           "the gateway's figures.", ""]
    late = [r for r in runs if _late_share(r) > 0.05]
    out += [f"Simulated engines keep their profiles only while their steps go out on time: {len(late)} of "
            f"{len(runs)} run(s) had more than 5 % of steps late (the worst: {max(map(_late_share, runs)):.1%}); "
            "each run's share is given with it.", ""]
    if split:
        out += _split_section(split)
    if shadow:
        out += _shadow_section(shadow)
    return "\n".join(out) + "\n"


def _split_section(split: list[dict]) -> list[str]:
    out = ["## Split: half the users on each engine", ""]
    agree = {m: 0 for m in EXPECTED}
    floors: dict[str, list[float]] = {m: [] for m in METRICS}
    for i, run in enumerate(split, 1):
        x = run["experiment"]
        arms = {a["name"]: a["classes"].get("all", {}).get("requests", 0) for a in x["arms"]}
        failed = sum(1 for r in run["records"] if not r.get("ok"))
        out += [f"### Run {i}", "",
                f"Requests per arm: {', '.join(f'{k} {v}' for k, v in arms.items())}; failed at the client: "
                f"{failed} of {len(run['records'])}. Simulated engine steps: {_late(run)}.", "",
                "| class | metric | n (vllm / sglang) | ratio sglang/vllm [95 % CI] | noise floor | verdict | client ratio |",
                "|---|---|---|---|---|---|---|"]
        for c in _comparisons(run):
            client = _client_ratio(run["records"], c["metric"], *c["arms"]) \
                if c["class"] == "all" and c["metric"] in ("ttft", "itl", "e2e") else None
            out.append(_cells(c) + f" {_fmt(client)} |")
            if c["class"] == "all":
                if c["noise_floor"] is not None:
                    floors[c["metric"]].append(c["noise_floor"])
                if EXPECTED.get(c["metric"]) == c["verdict"]:
                    agree[c["metric"]] += 1
        out.append("")
    out += ["### Reading", ""]
    for metric, want in EXPECTED.items():
        better = "vLLM" if want == "a_better" else "SGLang"
        out.append(f"- {metric.upper()} over all classes: the verdict named {better} better, as the profiles say, in "
                   f"{agree[metric]} of {len(split)} run(s).")
    measured = ", ".join(f"{m} {_fmt(kit.median_or_none(v))}" for m, v in floors.items() if v)
    out += [f"- Measured noise floor (A/A halves of one arm, 95th percentile of the gap; median over runs, as a "
            f"fraction of the mean): {measured}.", ""]
    return out


def _shadow_section(shadow: list[dict]) -> list[str]:
    out = ["## Shadow: vLLM serves, every request copied to SGLang", "",
           "The simulator's output text is a function of its seed and the prompt, whatever the engine flavour, "
           "and both simulated engines run with the same seed, so they agree by construction: these runs show that the comparison finds agreement where "
           "there is some; tests/integration/test_shadow.py shows it finds none where there is none.", ""]
    for i, run in enumerate(shadow, 1):
        x = run["experiment"]
        cand = next(a for a in x["arms"] if a["name"] != "primary")
        sh = cand.get("shadow", {})
        ag = sh.get("agreement", {})
        prefix = ag.get("common_prefix_share") or {}
        tokens = ag.get("common_prefix_tokens") or {}
        counts = ", ".join(f"{k} {sh[k]}" for k in ("sent", "ok", "engine_error", "skipped_busy",
                                                    "skipped_unhealthy") if k in sh)
        out += [f"### Run {i}", "",
                f"Copies: {counts}. Simulated engine steps: {_late(run)}.", "",
                f"Output agreement at temperature 0: {ag.get('exact', 0)} of {ag.get('compared', 0)} outputs "
                f"identical (rate {_fmt(ag.get('exact_rate'))}); common prefix {_fmt(prefix.get('mean'))} of the "
                f"primary's characters on average (median {_fmt(prefix.get('p50'))}), "
                f"{_fmt(tokens.get('mean'), 1)} tokens on average.", "",
                "| class | metric | n (primary / sglang) | ratio sglang/primary [95 % CI] | noise floor | verdict |",
                "|---|---|---|---|---|---|"]
        out += [_cells(c) for c in _comparisons(run)]
        out.append("")
    return out
