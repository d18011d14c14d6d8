"""10,000 concurrent slow streams through one gateway process: memory per stream, loop lag, errors."""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import kit
from deploy.compile import compiled_copy

FILES = 65_536  # two sockets per stream in the gateway; raised as far as the process may (root, CAP_SYS_RESOURCE)
SPARE_FILES = 200  # the gateway's own: listening socket, log, probes, scrapes of /metrics, Redis


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def schedstat(pid: int) -> tuple[float, float, int]:
    """The main thread's time on a core, its time runnable but waiting for one (seconds), and its time slices:
    lag that is waiting for a core is the machine's contention, not the loop's own work."""
    run_ns, wait_ns, slices = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[:3]
    return int(run_ns) / 1e9, int(wait_ns) / 1e9, int(slices)


def more_files() -> None:
    """Open files up to FILES if this process may raise its hard limit, else up to the hard limit."""
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (FILES, FILES))
    except (ValueError, OSError):
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def stream_room() -> int:
    """How many streams one process can hold here: two sockets each, under the open-files limit it can get."""
    try:
        out = subprocess.run([sys.executable, "-c", "import resource; print(resource.getrlimit("
                              "resource.RLIMIT_NOFILE)[0])"], preexec_fn=more_files, capture_output=True,
                             text=True, check=True).stdout
        return (int(out) - SPARE_FILES) // 2
    except (subprocess.CalledProcessError, ValueError):
        return 0


def room_settings(streams: int) -> tuple[str, str]:
    """`[server]` lines and an `[upstream]` section with the connection limits raised to fit `streams`."""
    room = streams + 1000
    return (f"max_connections = {room}\nmax_reading_connections = {room}",
            f"[upstream]\npool_limit = {room}\npool_limit_per_backend = {room}")


def lag_quantile(d: dict[str, float], q: float) -> float | None:
    """The upper bound of the lag bucket holding quantile q of the window's samples (Prometheus' le)."""
    buckets = sorted((float(k.split('le="')[1].rstrip('"}')), v) for k, v in d.items()
                     if k.startswith("shapegate_event_loop_lag_seconds_bucket"))
    total = d.get("shapegate_event_loop_lag_seconds_count", 0.0)
    for le, count in buckets:
        if total and count >= q * total:
            return le
    return None


def gc_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, list[float]]:
    """Per generation: collections and their pause in ms between two scrapes."""
    def d(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)
    return {str(g): [d(f'shapegate_gc_pause_seconds_count{{generation="{g}"}}'),
                     1000 * d(f'shapegate_gc_pause_seconds_sum{{generation="{g}"}}')] for g in (0, 1, 2)}


BUILDS = ("sources", "compiled")  # the plain sources, and the copy compiled by deploy/compile.py (what the image runs)


def measure(args) -> dict:
    """`args.rounds` rounds of each build, each round with its own engine, gateway and client; the builds take
    turns within a round, in the other order in the next."""
    room = stream_room()
    cond = {**kit.provenance(), "command": kit.command("benchmarks.streams_10k"),
            "asked": args.streams, "room": room, "streams": min(args.streams, room), "rate": args.rate,
            "hold_s": args.hold, "interval_s": 1.0, "rounds": args.rounds, "builds": list(args.builds)}
    args.streams = cond["streams"]
    rounds = []
    with tempfile.TemporaryDirectory() as d:
        trees = {"sources": kit.ROOT}
        if "compiled" in args.builds:
            trees["compiled"] = Path(d) / "compiled"
            cond["compile_s"] = round(compiled_copy(trees["compiled"]))
        for i in range(args.rounds):
            for build in (args.builds if i % 2 == 0 else args.builds[::-1]):
                rounds.append({"build": build, **one_round(args, trees[build])})
                print(json.dumps({"round": i, **{k: v for k, v in rounds[-1].items() if not isinstance(v, dict)}}),
                      flush=True)
    cond["load_after"] = os.getloadavg()
    return {"conditions": cond, "rounds": rounds}


def one_round(args, src: Path) -> dict:
    """One engine, one gateway (from the tree `src`) and one client: every stream opened, held, ended."""
    tokens = int(args.streams / args.rate + args.hold + 10)
    out: dict = {"tokens_per_stream": tokens}
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        try:
            engine = kit.start_engine(procs, "--tokens", str(tokens), name="slow_engine.py", preexec_fn=more_files)
            server, upstream = room_settings(args.streams)
            cfg = kit.gateway_config(tmp / "gw.toml", engine, server=server, sections=upstream)
            with tmp.joinpath("gw.log").open("wb") as log:
                base, gw = kit.start_gateway(cfg, procs, tree=src, stdout=subprocess.DEVNULL, stderr=log,
                                             preexec_fn=more_files)
            time.sleep(1.0)
            out["rss_idle_mb"] = rss_mb(gw.pid)
            f_idle = kit.loop_figures(base)
            client = subprocess.Popen(kit.script("streams_client.py", "--port", base.rsplit(":", 1)[1], "--streams",
                                                 str(args.streams), "--rate", str(args.rate), "--key", kit.KEY),
                                      stdout=subprocess.PIPE, text=True, preexec_fn=more_files)
            procs.append(client)
            assert client.stdout is not None
            opened = json.loads(client.stdout.readline() or "{}")
            out["all_open"] = opened
            time.sleep(2.0)  # the last streams' heads and first tokens
            others = {"engine": procs[0].pid, "client": client.pid}
            o0 = {k: kit.cpu_seconds(pid) for k, pid in others.items()}
            f0, c0, s0, t0 = kit.loop_figures(base), kit.cpu_seconds(gw.pid), schedstat(gw.pid), time.monotonic()
            peak = rss_mb(gw.pid)
            window = max(args.hold - 4.0, 2.0)
            while time.monotonic() - t0 < window:
                time.sleep(1.0)
                peak = max(peak, rss_mb(gw.pid))
            f1, c1, s1, t1 = kit.loop_figures(base), kit.cpu_seconds(gw.pid), schedstat(gw.pid), time.monotonic()
            o1 = {k: kit.cpu_seconds(pid) for k, pid in others.items()}
            lag = {k: v - f0.get(k, 0.0) for k, v in f1.items()}
            out.update(rss_held_mb=peak, window_s=t1 - t0, cpu_share=(c1 - c0) / (t1 - t0),
                       others_cpu_share={k: (o1[k] - o0[k]) / (t1 - t0) for k in others},
                       loop_thread={"run_s": s1[0] - s0[0], "wait_s": s1[1] - s0[1], "slices": s1[2] - s0[2]},
                       lag_samples=lag.get("shapegate_event_loop_lag_seconds_count", 0.0),
                       lag_p50_le_s=lag_quantile(lag, 0.5), lag_p99_le_s=lag_quantile(lag, 0.99),
                       lag_max_le_s=lag_quantile(lag, 1.0), gc_ramp=gc_figures(f_idle, f0), gc_window=gc_figures(f0, f1))
            rest = client.stdout.read()
            client.wait(timeout=tokens + 60)
            out["client"] = json.loads(rest.strip().splitlines()[-1])
            out["rss_after_mb"] = rss_mb(gw.pid)
        finally:
            kit.stop_all(procs, timeout=15)
    return out


def figures(r: dict) -> list[tuple[str, str]]:
    """One round's figures, as (row label, cell text)."""
    cl, t, o = r["client"], r["loop_thread"], r["others_cpu_share"]
    per_slice_ms = 1000 * t["wait_s"] / t["slices"] if t["slices"] else 0.0
    lag = (f"{r['lag_p50_le_s'] * 1000:g} ms / {r['lag_p99_le_s'] * 1000:g} ms ({r['lag_samples']:.0f} samples; all "
           f"within {(r['lag_max_le_s'] or 0) * 1000:g} ms)" if r["lag_p99_le_s"] is not None
           and r["lag_p50_le_s"] is not None else "no samples")
    return [
        ("streams opened / completed with [DONE]", f"{cl['opened']:,} / {cl['completed']:,}"),
        ("time to open them all", f"{r['all_open']['seconds']:.1f} s"),
        ("gateway RSS idle -> all open", f"{r['rss_idle_mb']:,.0f} MB -> {r['rss_held_mb']:,.0f} MB"),
        ("memory per open stream", f"{per_stream_kb(r):,.1f} KB"),
        ("gateway CPU while all open (share of one core)", f"{r['cpu_share']:.0%}"),
        ("loop lag p50 / p99 (bucket bounds)", lag),
        ("engine / client CPU while all open", f"{o['engine']:.0%} / {o['client']:.0%}"),
        ("the loop's thread runnable but waiting for a core (/proc schedstat)",
         f"{1000 * t['wait_s'] / r['window_s']:,.0f} ms a second, {per_slice_ms:.2f} ms a wait"),
        ("tokens received by the client", f"{cl['tokens']:,}"),
        *[(f"garbage collections {when} (generation: count, pause)",
           "; ".join(f"{g}: {int(n)}, {ms:,.1f} ms" for g, (n, ms) in r[key].items()))
          for when, key in (("while streams opened", "gc_ramp"), ("while all open", "gc_window"))]]


def per_stream_kb(r: dict) -> float:
    return (r["rss_held_mb"] - r["rss_idle_mb"]) * 1024 / max(r["client"]["opened"], 1)


def errors(r: dict) -> int:
    return r["client"]["requested"] - r["client"]["completed"]


def build_section(c: dict, build: str, rounds: list[dict], heading: bool) -> list[str]:
    """One build's table, medians and checks."""
    n = len(rounds)
    lag99 = [r["lag_p99_le_s"] for r in rounds]
    rss = [r["rss_held_mb"] for r in rounds]
    lag_med = statistics.median(x if x is not None else math.inf for x in lag99)
    checks = [("RSS under 1 GB with every stream open", max(rss) < 1024,
               f"{statistics.median(rss):,.0f} MB median, {max(rss):,.0f} MB at most"),
              ("0 errors", sum(map(errors, rounds)) == 0,
               f"{sum(map(errors, rounds))} of {sum(r['client']['requested'] for r in rounds):,} streams did not end "
               f"with [DONE]; statuses by round {[r['client']['statuses'] for r in rounds]}, connect errors "
               f"{[r['client']['connect_errors'] for r in rounds]}"),
              ("loop lag p99 under 10 ms", lag_med <= 0.01,
               f"median of the rounds' p99 buckets {lag_med * 1000:g} ms; under 10 ms in "
               f"{sum(1 for x in lag99 if x is not None and x <= 0.01)} of {n} rounds")]
    rows = [f"| {label} | " + " | ".join(f[i][1] for f in map(figures, rounds)) + " |"
            for i, (label, _) in enumerate(figures(rounds[0]))]
    kb = [per_stream_kb(r) for r in rounds]
    cpu = [r["cpu_share"] for r in rounds]
    return [*([f"## {BUILD_TITLES[build]}", ""] if heading else []),
            "| figure | " + " | ".join(f"round {i + 1}" for i in range(n)) + " |", "|---|" + "---|" * n, *rows, "",
            f"Medians of the rounds: {statistics.median(kb):,.1f} KB of memory per open stream "
            f"({min(kb):,.1f}-{max(kb):,.1f}), gateway CPU {statistics.median(cpu):.0%} of one core "
            f"({min(cpu):.0%}-{max(cpu):.0%}) while relaying {c['streams'] / c['interval_s']:,.0f} tokens a second.", "",
            f"Checks{' (' + build + ')' if heading else ''}:", "",
            *[f"- {name}: {'met' if ok else 'NOT met'} ({how})." for name, ok, how in checks], ""]


BUILD_TITLES = {"sources": "The plain sources", "compiled": "Compiled (`deploy/compile.py`, as the image runs)"}


def markdown(data: dict) -> str:
    c, rounds = data["conditions"], data["rounds"]
    builds = c.get("builds", ["sources"])  # (runs before the compiled build was measured: the sources only)
    by_build = {b: [r for r in rounds if r.get("build", "sources") == b] for b in builds}
    first = rounds[0]
    both = len(builds) > 1
    which = ("the plain sources and a copy compiled by `deploy/compile.py` (what the image runs) take turns within "
             "each round, in the other order in the next" if both else
             "the gateway runs " + ("from the plain sources" if builds == ["sources"] else "the compiled copy"))
    return "\n".join([
        "# 10,000 concurrent streams in one gateway process", "",
        kit.run_line(c) + ".", "",
        f"One gateway process (default config but for connection limits raised to fit {c['streams']:,} streams, "
        "access log on to /dev/null, API-key auth) in front of `benchmarks/slow_engine.py`, which sends one token "
        f"per stream every {c['interval_s']:g} s ({first['tokens_per_stream']} tokens each); "
        f"`benchmarks/streams_client.py` opens {c['streams']:,} streams at {c['rate']:g} a second and holds "
        f"each to its end. Engine, gateway and client share the machine's cores. {c['rounds']} rounds"
        f"{' of each build' if both else ''}, each with a new engine, gateway and client; {which}. Memory is the "
        "gateway's RSS; lag is its own `shapegate_event_loop_lag_seconds` over the window while every stream was "
        f"open (a window of {statistics.median(r['window_s'] for r in rounds):.0f} s).", "",
        *([f"The open-files limit this machine grants a process ({(c['room'] * 2 + SPARE_FILES):,}, not raisable "
           f"here) holds at most {c['room']:,} streams of two sockets each: {c['streams']:,} were run, not "
           f"{c['asked']:,}.", ""] if c["streams"] < c["asked"] else []),
        *[line for b in builds for line in build_section(c, b, by_build[b], both)]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--streams", type=int, default=10_000)
    ap.add_argument("--rate", type=float, default=500.0)
    ap.add_argument("--hold", type=float, default=30.0, help="seconds with every stream open")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--builds", nargs="+", choices=BUILDS, default=list(BUILDS))
    ap.add_argument("--render", action="store_true")
    a = ap.parse_args()
    kit.save_and_render("streams_10k", None if a.render else measure(a), markdown)

if __name__ == "__main__":
    main()
