"""shapegate beside the peer routers (vLLM router, SGLang router, nginx): same engines and client, rounds mixed."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks import kit
from benchmarks import peers_targets as pt
from benchmarks.peers_report import markdown

POINTS = (("nonstream", 1), ("nonstream", 64), ("stream", 1), ("stream", 64), ("stream-rate", 64))
# "stream-rate": streams started at this rate over 64 workers, whatever the target relays. At c=64 without a rate a
# faster relay also loads the engines and the client more (they share the cores), and their own delays reach its
# first tokens; at one rate, well under every target's capacity, each carries the same tokens a second.
STREAM_RATE = 400
WRK_CONC = 64

Starter = Callable[[Path, list[str]], pt.Target]
STARTERS: dict[str, Starter] = {
    "shapegate": lambda tmp, e: pt.start_shapegate(tmp, e, 1),
    "shapegate-w2": lambda tmp, e: pt.start_shapegate(tmp, e, 2),
    "shapegate-source": lambda tmp, e: pt.start_shapegate(tmp, e, 1, compiled=False),
    "python-floor": pt.start_parsing_proxy,
    "vllm-router": pt.start_vllm_router,
    "sglang-router": pt.start_sglang_router,
    "nginx": pt.start_nginx,
}
LABELS = {"direct": "direct", "shapegate": "shapegate", "shapegate-w2": "shapegate --workers 2",
          "shapegate-source": "shapegate, uncompiled",
          "python-floor": "Python floor", "vllm-router": "vLLM router", "sglang-router": "SGLang router",
          "nginx": "nginx"}


def client_point(t: pt.Target, kind: str, conc: int, seconds: float, warmup: float) -> dict:
    """One point: the client in its own process; the target's CPU read when the client opens and closes its
    measured window (it prints a line at each edge), so warm-up and the last replies are not counted."""
    cmd = kit.script("peers_client.py", "--url", t.url + "/v1/chat/completions", "--kind", kind.removesuffix("-rate"),
                     "--conc", str(conc), "--seconds", str(seconds), "--warmup", str(warmup), "--key", kit.KEY)
    if kind.endswith("-rate"):
        cmd += ["--rate", str(STREAM_RATE)]
    load_before = os.getloadavg()
    cpu: dict[str, float] = {}
    result: dict = {}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as client:
        assert client.stdout is not None
        for line in client.stdout:
            word = line.strip()
            if word in ("measure", "stop") and t.proc is not None:
                cpu[word] = pt.tree_cpu(t.proc.pid)
            elif word.startswith("RESULT "):
                result = json.loads(word[7:])
    if client.returncode != 0 or not result:
        raise RuntimeError(f"the load client failed on {t.id} {kind} c={conc} (exit {client.returncode})")
    cpu_s = cpu["stop"] - cpu["measure"] if len(cpu) == 2 else None
    result.update(target=t.id, kind=kind, conc=conc, load_before=load_before, load_after=os.getloadavg(),
                  cpu_s=cpu_s, cpu_per_req_us=cpu_s / result["requests"] * 1e6
                  if cpu_s is not None and result["requests"] else None)
    return result


def wrk_point(t: pt.Target, seconds: float, script: str) -> dict:
    """The cross-check: wrk at c=64, non-streamed, on the same target."""
    c0 = pt.tree_cpu(t.proc.pid) if t.proc is not None else None
    try:
        r = kit.run_wrk(t.url + "/v1/chat/completions", kit.BODIES["nonstream"], WRK_CONC, seconds, script)
    except subprocess.CalledProcessError as e:
        return {"target": t.id, "error": pt.first_line(e.stderr or str(e))}
    cpu = pt.tree_cpu(t.proc.pid) - c0 if t.proc is not None and c0 is not None else None
    r.update(target=t.id, rps=r["requests"] / (r["duration_us"] / 1e6),
             cpu_per_req_us=cpu / r["requests"] * 1e6 if cpu is not None and r["requests"] else None)
    return r


def round_order(ids: list[str], rnd: int) -> list[str]:
    """Round 1 in the listed order, round 2 reversed, then rotations: no target always runs first or last."""
    if rnd < 2:
        return ids[::-1] if rnd else list(ids)
    k = (len(ids) // 2 + rnd - 2) % len(ids)  # round 3 starts in the middle: a new first and a new last
    return ids[k:] + ids[:k]


def alive(t: pt.Target, status: dict) -> bool:
    """False (and the target marked failed) once a target's process has exited during the run."""
    if t.proc is None or t.proc.poll() is None:
        return True
    said = pt.first_line(t.log.read_text(errors="replace")) if t.log is not None and t.log.exists() else ""
    status[t.id].update(status="failed", stage="run",
                        error=f"exited with code {t.proc.returncode} during the run" + (f": {said}" if said else ""))
    return False


def start_all(args, tmp: Path, engines: list[str], out: dict) -> list[pt.Target]:
    """direct and every target that installs and starts; the others are recorded with their error."""
    targets = [pt.Target("direct", "direct", engines[0], None, "-", "the client straight to engine 1")]
    out["targets"]["direct"] = {"label": "direct", "status": "ok", "version": "-", "command": targets[0].command}
    for tid in args.targets:
        status = {"label": LABELS[tid]}
        try:
            t = STARTERS[tid](tmp, engines)
        except pt.Unavailable as e:
            out["targets"][tid] = {**status, "status": "failed", "stage": e.stage, "error": str(e)}
            print(f"{tid}: failed: {e}", flush=True)
            continue
        targets.append(t)
        out["targets"][tid] = {**status, "status": "ok", "version": t.version, "command": t.command}
        print(f"{tid}: {t.version} at {t.url}", flush=True)
    return targets


def warm_all(args, targets: list[pt.Target], out: dict) -> None:
    """First requests pay for connections, imports and caches: every target is warmed before round 1."""
    for t in targets:
        for kind in ("nonstream", "stream"):
            try:
                client_point(t, kind, 8, args.warmup_s, 0.0)
            except RuntimeError as e:
                out["targets"][t.id].update(status="failed", stage="warm-up", error=str(e))
        if t.proc is not None:
            out["targets"][t.id]["shape"] = pt.tree_shape(t.proc.pid)


def run_rounds(args, targets: list[pt.Target], script: str, out: dict) -> None:
    """Each round: every point on every target (in the round's order), then wrk on every target."""
    by_id = {t.id: t for t in targets}

    def runs(tid: str) -> bool:
        return out["targets"][tid]["status"] == "ok" and alive(by_id[tid], out["targets"])

    for rnd in range(args.rounds):
        order = round_order(list(by_id), rnd)
        out["orders"].append(order)
        for kind, conc in POINTS:
            for pos, tid in enumerate(order):
                if not runs(tid):
                    continue
                try:
                    p = client_point(by_id[tid], kind, conc, args.seconds, args.warmup)
                except RuntimeError as e:
                    out["targets"][tid].update(status="failed", stage="run", error=str(e))
                    continue
                p.update(round=rnd, position=pos)
                out["points"].append(p)
                print(json.dumps({k: p[k] for k in ("round", "target", "kind", "conc", "rps", "p50_us",
                                                    "ttft_p50_us", "cpu_per_req_us", "errors")}), flush=True)
        for tid in order if args.wrk_seconds > 0 else ():
            if runs(tid):
                w = wrk_point(by_id[tid], args.wrk_seconds, script)
                out["wrk"].append({**w, "round": rnd})
                print(json.dumps(w), flush=True)


def measure(args, tmp: Path, out: dict) -> None:
    procs: list[subprocess.Popen] = []
    try:
        engines = pt.start_engines(2, tmp)
        procs += [p for _, p in engines]
        targets = start_all(args, tmp, [u for u, _ in engines], out)
        procs += [t.proc for t in targets if t.proc is not None]
        warm_all(args, targets, out)
        run_rounds(args, targets, kit.wrk_script(tmp), out)
    finally:
        kit.stop_all(procs)


def conditions(args) -> dict:
    c = kit.provenance()
    c.update(command=kit.command("benchmarks.peers"), cores=os.cpu_count(),
             seconds=args.seconds, warmup=args.warmup, rounds=args.rounds, wrk_seconds=args.wrk_seconds,
             wrk=kit.wrk_version(), points=[list(p) for p in POINTS],
             stream_rate=STREAM_RATE,
             engines="2 x benchmarks/fast_engine.py (zero delay, 16-token replies, 200-chunk streams)",
             shapegate_build="compiled")
    return c


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=5.0, help="measured window per point (default 5)")
    p.add_argument("--warmup", type=float, default=1.0, help="load before each window, not counted (default 1)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, every target in each, the order changing")
    p.add_argument("--wrk-seconds", type=int, default=5,
                   help="wrk cross-check per target and round, whole seconds (0: none)")
    p.add_argument("--warmup-s", type=float, default=1.0, help="warm-up per target and kind before round 1")
    p.add_argument("--targets", nargs="+", choices=list(STARTERS), default=list(STARTERS))
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 rounds of 0.5 s points, 1 s of wrk")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                   help="wait up to S seconds for others to leave the cores before starting")
    p.add_argument("--out", default=str(kit.RESULTS / "peers"), help="writes OUT.md and OUT.json")
    p.add_argument("--render", action="store_true", help="only write OUT.md again from OUT.json")
    args = p.parse_args()
    dest = Path(args.out)
    if args.render:
        kit.render_again(dest, markdown)
        return 0
    if args.quick:
        args.seconds, args.warmup, args.rounds, args.wrk_seconds, args.warmup_s = 0.5, 0.2, 2, 1, 0.3
    wrk_missing = None
    try:
        pt.apt_binary("wrk", "wrk")
    except pt.Unavailable as e:  # the cross-check is left out, and the report says why
        wrk_missing, args.wrk_seconds = str(e), 0
    out: dict = {"conditions": conditions(args), "targets": {}, "orders": [], "points": [], "wrk": []}
    if wrk_missing:
        out["conditions"]["wrk"] = f"wrk unavailable ({wrk_missing})"
    if args.wait_quiet > 0:
        out["conditions"]["quiet_wait"] = kit.wait_quiet(args.wait_quiet)
    out["conditions"]["busy_cores_before"] = round(kit.busy_cores(1.0), 2)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="peers-") as d:
        measure(args, Path(d), out)
    out["conditions"].update(load_after=os.getloadavg(), duration_s=round(time.monotonic() - started))
    report = markdown(out)
    kit.write_result(dest, out, report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
