"""CPU per request with no saturation, the gateway's queue on and off, side by side: instructions per
request under callgrind, and CPU seconds per request of a plain process, each round alternating the two."""

# With no backend saturated a request passes the queue with one check per candidate (a seat free, nothing waiting
# for its model): this measures what that check costs. Instructions are counted as benchmarks/path_instructions.py
# counts them (its engines, client and idle-rate correction); CPU seconds come from /proc for the same requests
# sent to a gateway not under callgrind, a figure a busy shared machine moves by several per cent.
#
# Usage: python3 -m benchmarks.queue_cpu [--rounds 3] [--requests 2000] [--streams 40] [--render]
# Writes benchmarks/results/queue_cpu.{md,json}.

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks import kit
from benchmarks.path_instructions import config as counted_config
from benchmarks.path_instructions import per_request, send, start_counted, start_engine

TARGETS = {"queue on": "[queue] enabled = true, its other settings the defaults", "queue off": "[queue] enabled = false"}
KINDS = ("nonstream", "stream")
QUEUE = {"queue on": "[queue]\nenabled = true\n", "queue off": "[queue]\nenabled = false\n"}


def config(path: Path, engine: str, target: str) -> Path:
    cfg = counted_config(path, engine, None)
    cfg.write_text(cfg.read_text().replace("[[backends]]", QUEUE[target] + "\n[[backends]]", 1))
    return cfg


def measure(args) -> dict:
    cond = {**kit.provenance(), "command": kit.command("benchmarks.queue_cpu"), "rounds": args.rounds,
            "requests": {"nonstream": args.requests, "stream": args.streams}, "idle_s": args.idle, "warm": args.warm}
    points: list[dict] = []
    for kind in KINDS:
        procs: list[subprocess.Popen] = []
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            try:
                engine = start_engine(kind, procs)
                counted, plain = {}, {}
                for i, t in enumerate(TARGETS):
                    cfg = config(tmp / f"{i}.toml", engine, t)
                    counted[t] = (*start_counted(kit.ROOT, cfg, tmp / f"cg{i}", procs), tmp / f"cg{i}")
                    base, proc = kit.start_gateway(cfg, procs, **kit.QUIET)
                    plain[t] = (int(base.rsplit(":", 1)[1]), proc.pid)
                for t in TARGETS:
                    kit.wait_http(f"http://127.0.0.1:{counted[t][0]}/readyz", timeout=600)
                    send(counted[t][0], kind, args.warm)
                    send(plain[t][0], kind, args.warm)
                n = cond["requests"][kind]
                for rnd in range(args.rounds):
                    for t in (list(TARGETS) if rnd % 2 == 0 else list(TARGETS)[::-1]):
                        port, pid, out_dir = counted[t]
                        idle = kit.window(pid, out_dir, lambda: time.sleep(args.idle))
                        busy = kit.window(pid, out_dir, lambda p=port, k=kind, n=n: send(p, k, n))
                        pport, ppid = plain[t]
                        c0, w0 = kit.cpu_seconds(ppid), time.perf_counter()
                        send(pport, kind, n)
                        cpu, wall = kit.cpu_seconds(ppid) - c0, time.perf_counter() - w0
                        point = {"kind": kind, "target": t, "round": rnd, "requests": n, "busy": busy, "idle": idle,
                                 "cpu_s": cpu, "wall_s": wall, "load1": os.getloadavg()[0]}
                        points.append(point)
                        print(json.dumps(point), flush=True)
            finally:
                kit.stop_all(procs)
    cond["load_after"] = os.getloadavg()
    return {"conditions": cond, "points": points}


def markdown(data: dict) -> str:
    c = data["conditions"]
    lines = ["# CPU per request with no saturation: the queue on and off", "", kit.run_line(c) + ".", "",
             "Two gateways of this tree in front of one local engine that is never saturated (no seat count is "
             "known for it, so every request finds a seat): the queue on (`[queue] enabled = true`, the rest "
             "its defaults) and off (`[queue] enabled = false`, where `[admission]` alone decides, as before the queue). Each is run "
             "twice: under `valgrind --tool=callgrind`, counting the instructions the process executes in user "
             "space per request (`benchmarks/path_instructions.py`'s method: its config, engines and client, one "
             "request at a time on one keep-alive connection, less the timer-driven work at an idle window's "
             "rate), and as a plain process whose CPU seconds (/proc, user + system) over the same number of "
             f"requests are divided by them. {c['rounds']} rounds, the two targets' order alternating; each cell "
             "lists the rounds, then their median.", ""]
    for kind in KINDS:
        rows = [p for p in data["points"] if p["kind"] == kind]
        if not rows:
            continue
        what = {"nonstream": f"Non-streamed request ({c['requests']['nonstream']:,} per round)",
                "stream": f"Stream ({c['requests']['stream']:,} per round)"}[kind]
        lines += [f"## {what}", "", "| target | instructions / request, by round | median | CPU µs / request, by "
                  "round | median |", "|---|---|---|---|---|"]
        med = {}
        for t, note in TARGETS.items():
            ins = [per_request(p) for p in rows if p["target"] == t]
            cpu = [p["cpu_s"] / p["requests"] * 1e6 for p in rows if p["target"] == t]
            med[t] = (kit.median_spread(ins)[0], kit.median_spread(cpu)[0])
            lines.append(f"| {t} ({note}) | {', '.join(f'{x:,.0f}' for x in ins)} | {med[t][0]:,.0f} | "
                         f"{', '.join(f'{x:,.0f}' for x in cpu)} | {med[t][1]:,.0f} |")
        on, off = med["queue on"], med["queue off"]
        lines += ["", f"Queue on against off: {on[0] - off[0]:+,.0f} instructions per request "
                  f"({(on[0] - off[0]) / off[0] * 100:+.1f} %), {on[1] - off[1]:+,.0f} µs of CPU per request "
                  f"({(on[1] - off[1]) / off[1] * 100:+.1f} %).", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=2000, help="non-streamed requests per round and target")
    ap.add_argument("--streams", type=int, default=40, help="streams per round and target")
    ap.add_argument("--warm", type=int, default=100)
    ap.add_argument("--idle", type=float, default=2.0, help="seconds of each round's idle window (callgrind)")
    ap.add_argument("--render", action="store_true", help="re-render the .md from the saved .json")
    args = ap.parse_args()
    if args.render:
        kit.save_and_render("queue_cpu", None, markdown)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    kit.save_and_render("queue_cpu", measure(args), markdown)


if __name__ == "__main__":
    main()
