"""CPU instructions a gateway executes per request (callgrind): with its defaults, with each optional feature off, and
a baseline revision beside it; a measure of the request path that a busy shared machine does not move."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks import kit
from deploy.compile import compiled_copy

# Why instructions: CPU time per request moves by 5-30 % from run to run on this machine kind (a shared virtual
# machine), more than most changes to the request path; callgrind counts what the process executes, the same for
# the same work. It counts user space only: the kernel's part (socket reads and writes) is not in it.
FEATURES = {"no access log": "[server] access_log = false",
            "no stats upkeep": "[stats] enabled = false (counters only)",
            "no API-key auth": "[auth] enabled = false",
            "round robin": "[routing] policy = \"round_robin\" instead of the default shape policy"}
# Probes and load scrapes an hour apart: after the first ones (at start) none falls inside a counted window.
# The same tree with the request path compiled by deploy/compile.py (what the image runs), defaults otherwise.
COMPILED = "compiled"
QUIET_HEALTH = "interval_s = 3600\nload_interval_s = 3600\nload_stale_s = 7200\n"
# The latency model solved again at most once an hour: one request at a time, it would be solved again for
# every request older than the least age (50 ms by default), so the count would rise with the wall time
# callgrind stretches each request to. Under load one solve serves many requests (a solve: ~20 us).
QUIET_REFIT = "refit_interval_s = 3600"
KINDS = ("nonstream", "stream", "stream-sglang")
STREAM_TOKENS = 50
# Tokens 10 ms apart: with 2 ms, a stream's count moved by up to 4 % between rounds (the gateway, slowed down by
# callgrind, likely finds more than one token in some reads).
STREAM_INTERVAL_S = 0.01
HEADERS = {"Authorization": f"Bearer {kit.KEY}", "Content-Type": "application/json"}


def config(path: Path, engine: str, feature_off: str | None, src: Path = kit.ROOT) -> Path:
    return kit.gateway_config(
        path, engine, access_log=feature_off != "no access log", stats=feature_off != "no stats upkeep",
        auth=feature_off != "no API-key auth", health=QUIET_HEALTH,
        sections='[routing]\npolicy = "round_robin"\n' if feature_off == "round robin" else "",
        stats_lines=QUIET_REFIT if "refit_interval_s" in (src / "gateway" / "config.py").read_text() else "")


def send(port: int, kind: str, n: int) -> None:
    """n requests of `kind` one after another on one keep-alive connection, each read to its end and checked."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = kit.BODIES["nonstream" if kind == "nonstream" else "stream"].encode()
    try:
        for _ in range(n):
            conn.request("POST", "/v1/chat/completions", body, HEADERS)
            r = conn.getresponse()
            data = r.read()
            assert r.status == 200, r.status
            if kind != "nonstream":
                assert data.count(b"tok ") == STREAM_TOKENS and b"[DONE]" in data, data[-200:]
    finally:
        conn.close()


def start_engine(kind: str, procs: list) -> str:
    """A zero-delay engine for whole replies, or one streaming STREAM_TOKENS tokens one write each (their chunks as
    vLLM's, or as SGLang's with "usage": null in each)."""
    if kind == "nonstream":
        return kit.start_engine(procs, **kit.QUIET)
    return kit.start_engine(procs, "--tokens", str(STREAM_TOKENS), "--interval", str(STREAM_INTERVAL_S),
                            *(["--null-usage"] if kind == "stream-sglang" else []), name="slow_engine.py", **kit.QUIET)


def start_counted(src: Path, cfg: Path, out_dir: Path, procs: list) -> tuple[int, int]:
    """A gateway from source tree src under callgrind with counting off: (port, pid)."""
    port = kit.free_port()
    out_dir.mkdir()
    p = subprocess.Popen([*kit.callgrind_argv(out_dir), *kit.serve_argv(cfg, port, src)], cwd=src,
                         env=kit.tree_env(src), **kit.QUIET)
    procs.append(p)
    return port, p.pid


def measure(args, baseline: Path | None, rev: str | None, compiled: Path | None = None) -> dict:
    cond = {**kit.provenance(), "command": kit.command("benchmarks.path_instructions"),
            "rounds": args.rounds, "requests": {k: args.requests if k == "nonstream" else args.streams for k in KINDS},
            "idle_s": args.idle, "warm": args.warm, "baseline": rev, "stream_tokens": STREAM_TOKENS,
            "stream_interval_s": STREAM_INTERVAL_S}
    targets = (["defaults", *([] if args.no_features else FEATURES)] + ([COMPILED] if compiled is not None else [])
               + ([f"baseline {rev}"] if baseline is not None else []))
    points: list[dict] = []
    for kind in args.kinds:
        procs: list[subprocess.Popen] = []
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            try:
                engine = start_engine(kind, procs)
                running = {}
                for i, name in enumerate(targets):
                    src = (baseline if name.startswith("baseline") and baseline is not None
                           else compiled if name == COMPILED and compiled is not None else kit.ROOT)
                    cfg = config(tmp / f"{i}.toml", engine, name if name in FEATURES else None, src)
                    running[name] = (*start_counted(src, cfg, tmp / f"cg{i}", procs), tmp / f"cg{i}")
                for name, (port, _, _) in running.items():
                    kit.wait_http(f"http://127.0.0.1:{port}/readyz", timeout=600)
                    send(port, kind, args.warm)
                for rnd in range(args.rounds):
                    for name in (targets if rnd % 2 == 0 else targets[::-1]):
                        port, pid, out_dir = running[name]
                        # Timer-driven work (the loop-lag probe, sweeps) runs by wall time, and callgrind stretches
                        # each window differently: its rate, with no request in flight, is taken out in the report.
                        idle = kit.window(pid, out_dir, lambda: time.sleep(args.idle))
                        n = cond["requests"][kind]
                        busy = kit.window(pid, out_dir, lambda p=port, k=kind, n=n: send(p, k, n))
                        point = {"kind": kind, "target": name, "round": rnd, "requests": n, "busy": busy, "idle": idle}
                        points.append(point)
                        print(json.dumps(point), flush=True)
            finally:
                kit.stop_all(procs)
    cond["load_after"] = os.getloadavg()
    return {"conditions": cond, "targets": targets, "points": points}


def per_request(p: dict) -> float:
    """A window's instructions per request, less the timer-driven work its wall time held at the idle rate."""
    idle_rate = p["idle"]["instructions"] / p["idle"]["wall_s"]
    return (p["busy"]["instructions"] - idle_rate * p["busy"]["wall_s"]) / p["requests"]


def markdown(data: dict) -> str:
    c = data["conditions"]
    lines = ["# Instructions per request, the request path's features one by one", "", kit.run_line(c) + ".", "",
             f"Each target is one gateway process (`benchmarks/overhead.py`'s config: API-key auth, a JSON access log "
             f"to /dev/null, stats upkeep, the default shape policy; probes and load scrapes an hour apart) run under "
             f"`valgrind --tool=callgrind` in front of a local engine. After {c['warm']} requests to warm it, "
             f"callgrind's counters are zeroed and one client sends the requests one after another on one keep-alive "
             f"connection: {c['requests']['nonstream']:,} non-streamed ones (`benchmarks/fast_engine.py`, a zero-delay "
             f"16-token reply) or {c['requests']['stream']:,} streams (`benchmarks/slow_engine.py`, "
             f"{c['stream_tokens']} tokens one write each, {c['stream_interval_s'] * 1000:g} ms apart, their chunks as "
             f"vLLM writes them or, with `--null-usage`, as SGLang does: `\"usage\": null` in each). Counted are "
             f"the instructions the gateway process executes in user space (not the kernel's socket work), less its "
             f"timer-driven work at the rate of an idle window of {c['idle_s']:g} s taken just before. "
             f"{c['rounds']} rounds, the targets' order alternating; figures are medians (± = (max-min)/median). One "
             f"request at a time: nothing is batched as it is under load, so these are the path's own instructions "
             f"per request, not its CPU time at c=64. The latency model is solved again at most once an hour "
             f"(`[stats] {QUIET_REFIT}`, where the tree has the setting): one request at a time, it would be "
             f"solved again for nearly every request (at most every 50 ms by default), as many times as the wall "
             f"time callgrind stretches the window to; under load one solve serves many requests."]
    if COMPILED in data["targets"]:
        lines[-1] += (f" The '{COMPILED}' target runs a copy of this tree in which `deploy/compile.py` has compiled "
                      f"the request path's modules with mypyc (as the image runs them); its config is the defaults'.")
    for kind in c["requests"]:
        rows = [p for p in data["points"] if p["kind"] == kind]
        if not rows:
            continue
        figures = {t: kit.median_spread([per_request(p) for p in rows if p["target"] == t]) for t in data["targets"]}
        base = figures["defaults"][0]
        what = {"nonstream": "Non-streamed request", "stream": f"Stream of {c['stream_tokens']} tokens",
                "stream-sglang": f"Stream of {c['stream_tokens']} tokens, SGLang's chunks"}[kind]
        lines += ["", f"## {what}", "", "| target | instructions / request | against the defaults |", "|---|---|---|"]
        for t, (m, spread) in figures.items():
            note = FEATURES.get(t, "this tree's source at an earlier commit" if t.startswith("baseline")
                                else "this tree, the request path compiled by deploy/compile.py" if t == COMPILED
                                else "")
            against = "" if t == "defaults" else f"{m - base:+,.0f} ({(m - base) / base * 100:+.1f} %)"
            lines.append(f"| {t}{f' ({note})' if note else ''} | {kit.pm((m, spread), spread='.1%')} | {against} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--baseline", help="a revision to count beside this tree (exported by git archive)")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=2000, help="non-streamed requests per window")
    ap.add_argument("--streams", type=int, default=40, help="streams per window")
    ap.add_argument("--warm", type=int, default=100)
    ap.add_argument("--idle", type=float, default=2.0, help="seconds of each round's idle window")
    ap.add_argument("--no-compiled", action="store_true", help="leave out the compiled build of this tree")
    ap.add_argument("--no-features", action="store_true", help="leave out the targets with a feature off")
    ap.add_argument("--name", default="path_instructions",
                    help="the results' file name under benchmarks/results/ (another keeps the full run's)")
    ap.add_argument("--render", action="store_true", help="re-render the .md from the saved .json")
    args = ap.parse_args()
    if args.render:
        kit.save_and_render(args.name, None, markdown)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    with tempfile.TemporaryDirectory() as d:
        baseline, rev = None, None
        if args.baseline:
            baseline = Path(d) / "baseline"
            rev = kit.export_revision(args.baseline, baseline)
        compiled = None
        if not args.no_compiled:
            compiled = Path(d) / "compiled"
            compiled_copy(compiled)
        kit.save_and_render(args.name, measure(args, baseline, rev, compiled), markdown)


if __name__ == "__main__":
    main()
