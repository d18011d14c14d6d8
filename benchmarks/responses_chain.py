"""A chained Responses turn beside a plain one of the same prompt: the gateway's CPU per request for a turn that
names a 20-turn chain (`previous_response_id`, expanded by the gateway) and for the same whole conversation sent
inline, stored and not; and Redis's memory per stored turn. One gateway, one zero-delay engine, in one run. With
`--instructions`, the gateway runs under callgrind and each kind is counted in instructions per request (the same
count whatever else the machine does), requests one after another on one connection.

    python3 -m benchmarks.responses_chain [--turns 20] [--seconds 4] [--repeats 3] [--state memory|redis]
                                          [--instructions N]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from benchmarks import kit
from benchmarks.path_instructions import QUIET_HEALTH, QUIET_REFIT

LIMIT = 1.3  # the requirement: a chained turn's CPU per request within this multiple of the plain turn's
OUT = kit.RESULTS / "responses_chain.md"


def call(base: str, method: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(base + path, method=method, data=json.dumps(body).encode() if body else None,
                                 headers={"Authorization": f"Bearer {kit.KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def make_chain(base: str, turns: int) -> list[str]:
    """A chain of `turns` stored turns (short questions, 16-token answers): their ids."""
    ids: list[str] = []
    for i in range(turns):
        body = {"model": "bench", "input": f"Turn {i}: tell me one more thing about the sea, briefly.",
                "max_output_tokens": 16}
        if ids:
            body["previous_response_id"] = ids[-1]
        ids.append(call(base, "POST", "/v1/responses", body)["id"])
    return ids


def build_chain(base: str, turns: int) -> tuple[str, list]:
    """A chain of `turns` stored turns; its last id, and the whole input its next turn is expanded to (the chain's
    items and outputs, as a client that keeps its own history would send them)."""
    prev = make_chain(base, turns)[-1]
    items = call(base, "GET", f"/v1/responses/{prev}/input_items?order=asc&limit=100")["data"]
    last = call(base, "GET", f"/v1/responses/{prev}")
    history = [{k: v for k, v in it.items() if k not in ("id", "status")} for it in items + last["output"]]
    return prev, history


def redis_bytes_per_turn(base: str, prefix: str, chains: int, turns: int) -> dict:
    """Redis's used_memory before and after `chains` more chains of `turns` stored turns each, per turn; the
    median size of those turns' records."""
    import redis
    r = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    before = r.info("memory")["used_memory"]
    made = [rid for _ in range(chains) for rid in make_chain(base, turns)]
    after = r.info("memory")["used_memory"]
    sizes = sorted(r.strlen(key) for key in r.scan_iter(match=f"{prefix}resp:*", count=1000)
                   if key.decode().rsplit(":", 1)[1] in set(made))
    r.close()
    n = chains * turns
    return {"chains": chains, "turns": turns, "used_memory_delta": after - before, "bytes_per_turn": (after - before) / n,
            "record_bytes_median": sizes[len(sizes) // 2] if sizes else 0, "records": len(sizes)}


def send(base: str, body: dict, n: int) -> None:
    """n requests one after another on one keep-alive connection, each read to its end and checked."""
    conn = http.client.HTTPConnection("127.0.0.1", int(base.rsplit(":", 1)[1]), timeout=300)
    data = json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {kit.KEY}", "Content-Type": "application/json"}
    try:
        for _ in range(n):
            conn.request("POST", "/v1/responses", data, headers)
            r = conn.getresponse()
            r.read()
            assert r.status == 200, r.status
    finally:
        conn.close()


def counted(args, kinds: dict, base: str, pid: int, out_dir: Path) -> list[dict]:
    """Instructions per request of each kind (callgrind), rounds rotating the order; timer-driven work taken out at
    the rate an idle window of the same gateway shows."""
    points = []
    for body in kinds.values():
        send(base, body, 20)  # warm every path
    names = list(kinds)
    for rep in range(args.repeats):
        for pos, kind in enumerate(names[rep % len(names):] + names[:rep % len(names)]):
            idle = kit.window(pid, out_dir, lambda: time.sleep(2.0))
            busy = kit.window(pid, out_dir, lambda k=kind: send(base, kinds[k], args.instructions))
            rate = idle["instructions"] / idle["wall_s"]
            per = (busy["instructions"] - rate * busy["wall_s"]) / args.instructions
            point = {"kind": kind, "rep": rep, "position": pos, "instructions_per_req": per, "busy": busy,
                     "idle": idle, "cpu_per_req_us": per}  # (the report's column reads instructions then)
            points.append(point)
            print(json.dumps(point), flush=True)
    return points


def measure(args) -> dict:
    cond = {**kit.provenance(), "command": kit.command("benchmarks.responses_chain"), "turns": args.turns,
            "seconds": args.seconds, "repeats": args.repeats, "state": args.state, "conc": args.conc,
            "wrk": kit.wrk_version()}
    if args.wait_quiet > 0:
        cond["quiet_wait"] = kit.wait_quiet(args.wait_quiet)
    procs: list[subprocess.Popen] = []
    prefix = f"bench-{uuid.uuid4().hex[:8]}:"
    state = (f'[state]\nbackend = "redis"\nkey_prefix = "{prefix}"\n' if args.state == "redis" else "")
    # Every stored request adds a record: bounds far above what a run makes, and a short life (they are not read)
    state += ("[responses]\nmax_per_key = 10000000\nmax_bytes_per_key = 8589934592\nmax_total = 10000000\n"
              "max_total_bytes = 8589934592\nttl_s = 600\n")
    points, memory = [], None
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        try:
            engine = kit.start_engine(procs, "--chunks", "16")
            # Counted in instructions, the timers' work (probes, load scrapes, the latency model's refit) would grow
            # with the wall time callgrind stretches each window to: an hour apart, as benchmarks/path_instructions.py
            quiet = args.instructions > 0
            cfg = kit.gateway_config(tmp / "bench.toml", engine, access_log=False, sections=state,
                                     health=QUIET_HEALTH if quiet else "", stats_lines=QUIET_REFIT if quiet else "")
            cfg.write_text(cfg.read_text().replace('engine = "openai"', 'engine = "vllm"'))
            out_dir = tmp / "cg"
            if args.instructions:
                out_dir.mkdir()
                port = kit.free_port()
                base = f"http://127.0.0.1:{port}"
                gw = kit.start(kit.callgrind_argv(out_dir) + kit.serve_argv(cfg, port), procs, base + "/readyz",
                               timeout=600, cwd=kit.ROOT, **kit.QUIET)
            else:
                base, gw = kit.start_gateway(cfg, procs, **kit.QUIET)
            last, history = build_chain(base, args.turns)
            # Each kind stored (`store` at its default: its record written before its reply) and not kept (`store:
            # false`: a plain turn is then passed on untouched, the harshest comparison).
            chained = {"model": "bench", "input": "And one more?", "previous_response_id": last,
                       "max_output_tokens": 16}
            plain = {"model": "bench", "input": [*history, {"role": "user", "content": "And one more?"}],
                     "max_output_tokens": 16}
            kinds = {"chained": chained, "plain": plain, "chained_unstored": {**chained, "store": False},
                     "plain_unstored": {**plain, "store": False}}
            cond["bodies_bytes"] = {k: len(json.dumps(b)) for k, b in kinds.items()}
            if args.instructions:
                cond["instructions"] = args.instructions
                points = counted(args, kinds, base, gw.pid, out_dir)
                if args.state == "redis":
                    memory = redis_bytes_per_turn(base, prefix, args.memory_chains, args.turns)
                return {"conditions": {**cond, "load_after": os.getloadavg()}, "points": points,
                        "redis_memory": memory}
            script = kit.wrk_script(tmp)
            for body in kinds.values():  # warm both paths
                kit.run_wrk(base + "/v1/responses", json.dumps(body), args.conc, 1.0, script)
            names = list(kinds)
            for rep in range(args.repeats):
                order = names[rep % len(names):] + names[:rep % len(names)]  # rotate: what runs first pays
                for pos, kind in enumerate(order):
                    c0 = kit.cpu_seconds(gw.pid)
                    r = kit.run_wrk(base + "/v1/responses", json.dumps(kinds[kind]), args.conc, args.seconds, script)
                    if r["errors"]:
                        raise SystemExit(f"{r['errors']} of {r['requests']} {kind} requests failed: no figure")
                    cpu = kit.cpu_seconds(gw.pid) - c0
                    r.update(kind=kind, rep=rep, position=pos, cpu_per_req_us=cpu / max(r["requests"], 1) * 1e6,
                             rps=r["requests"] / (r["duration_us"] / 1e6))
                    points.append(r)
                    print(json.dumps(r), flush=True)
            if args.state == "redis":
                memory = redis_bytes_per_turn(base, prefix, args.memory_chains, args.turns)
        finally:
            kit.stop_all(procs)
    cond["load_after"] = os.getloadavg()
    return {"conditions": cond, "points": points, "redis_memory": memory}


def report(run: dict) -> str:
    pts, c = run["points"], run["conditions"]
    by = {(p["kind"], p["rep"]): p for p in pts}
    reps = sorted({p["rep"] for p in pts})

    def ratios(suffix: str) -> list[float]:
        return [by[("chained" + suffix, r)]["cpu_per_req_us"] / by[("plain" + suffix, r)]["cpu_per_req_us"]
                for r in reps]
    counting = "instructions" in c
    how = (f"under `valgrind --tool=callgrind`, {c.get('instructions')} requests of each kind one after another on "
           f"one connection per point (instructions per request, with what the gateway's timers run while idle taken "
           f"out)" if counting else f"wrk at c={c['conc']} for {c['seconds']} s per point")
    lines = ["# A chained Responses turn beside a plain one", "",
             f"{kit.run_line(c)}.", "",
             f"One gateway (sources, `[state] backend = \"{c['state']}\"`) in front of `benchmarks/fast_engine.py` "
             f"(zero delay, 16-token replies), {how}, {c['repeats']} "
             f"repeats, the order rotating, every request checked to have succeeded. **chained**: "
             f"`previous_response_id` naming the last of a {c['turns']}-turn chain, which the gateway reads back and "
             f"expands ({c['bodies_bytes']['chained']} bytes sent); **plain**: the same conversation inline "
             f"({c['bodies_bytes']['plain']} bytes sent). Both stored (`store` at its default: the record written "
             f"before the reply goes out), and both with `store: false` (_unstored: the plain turn is then passed on "
             f"as it came, nothing read or written).", "",
             ("| kind | instructions per request (median, spread) |" if counting else
              "| kind | CPU per request, us (median, spread) | req/s (median) |"),
             "|---|---|" if counting else "|---|---|---|"]
    for kind in ("plain", "chained", "plain_unstored", "chained_unstored"):
        cpu = kit.median_spread([by[(kind, r)]["cpu_per_req_us"] for r in reps])
        if counting:
            lines.append(f"| {kind} | {kit.pm(cpu)} |")
        else:
            rps = kit.median_spread([by[(kind, r)]["rps"] for r in reps])
            lines.append(f"| {kind} | {kit.pm(cpu)} | {rps[0]:,.0f} |")
    for suffix, label in (("", "stored"), ("_unstored", "with `store: false`")):
        rs = ratios(suffix)
        m, s = kit.median_spread(rs)
        within = all(x <= LIMIT for x in rs)
        lines += ["", f"Chained over plain, {label}, repeat by repeat: {', '.join(f'{x:.2f}' for x in rs)}; median "
                  f"{m:.2f} (spread ±{s:.0%}); {'within' if within else '**not within**'} {LIMIT} in every repeat."]
    mem = run.get("redis_memory")
    if mem:
        lines += ["", f"Redis: {mem['chains']} chains of {mem['turns']} stored turns took {mem['used_memory_delta']:,} "
                  f"bytes of `used_memory`, {mem['bytes_per_turn']:,.0f} bytes a turn; their records' median size "
                  f"{mem['record_bytes_median']:,} bytes (a turn's own input items, the Response object and the ids "
                  f"of the turns before it; the rest is the indexes and Redis's own per-key cost)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--conc", type=int, default=8)
    ap.add_argument("--state", choices=("memory", "redis"), default="memory")
    ap.add_argument("--memory-chains", type=int, default=20,
                    help="chains of --turns turns stored to read Redis's memory per turn")
    ap.add_argument("--instructions", type=int, default=0, metavar="N",
                    help="count instructions (callgrind) over N requests a point instead of timing wrk")
    ap.add_argument("--wait-quiet", type=float, default=0.0, help="wait up to this long for a quiet machine first")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--json", type=Path, help="also write the raw run here")
    args = ap.parse_args(argv)
    run = measure(args)
    text = report(run)
    args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(run, indent=1))
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
