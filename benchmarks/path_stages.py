"""Where a request's time goes inside the gateway, stage by stage: the entry to each stage time-stamped in a running
gateway process, one request at a time, non-streamed and streamed; the map for making the request path cheaper."""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import kit

# (label, module, attribute): the callables whose entry opens a stage, roughly in the order a request meets them.
# A function is stamped where its callers look it up: a module's global, or a class's attribute.
STAGES = (
    ("request bytes in", "gateway.http.connection", "FrontConnection.data_received"),
    ("request's task runs", "gateway.pipeline", "serve_api"),
    ("pipeline", "gateway.pipeline", "handle"),
    ("classify", "gateway.pipeline", "classify"),
    ("candidates", "gateway.fleet.pool", "Pool.candidates"),
    ("fitting", "gateway.pipeline", "fitting"),
    ("admission", "gateway.pipeline", "admit"),
    ("policy rank", "policies.shape", "Shape.rank"),
    ("dispatch", "gateway.pipeline", "dispatch"),
    ("attempt", "gateway.upstream", "attempt"),
    ("upstream write", "backends.http1", "Connection.send"),
    ("engine bytes in", "backends.http1", "Connection.data_received"),
    ("engine head parsed", "backends.http1", "Connection.on_headers_complete"),
    ("reply read", "backends.http1_response", "Response.read"),
    ("stream relay", "gateway.upstream", "stream_reply"),
    ("usage", "gateway.upstream", "usage_of"),
    ("reply headers", "gateway.runtime", "Gateway.reply_headers"),
    ("client write", "gateway.http.connection", "FrontConnection.send_now"),
    ("record", "gateway.runtime", "Gateway.record"),
    ("finish", "gateway.runtime", "Gateway.finish"),
)
FIRST = STAGES[0][0]


# -- in the gateway process ----------------------------------------------------------------------
class Stamps:
    """The first entry time of each stage, request by request (requests come one at a time)."""

    def __init__(self) -> None:
        self.current: dict[str, int] = {}
        self.rows: list[dict[str, int]] = []

    def mark(self, label: str) -> None:
        if label == FIRST and "finish" in self.current:
            self.rows.append(self.current)
            self.current = {}
        self.current.setdefault(label, time.perf_counter_ns())

    def take(self) -> list[dict[str, int]]:
        rows, self.rows, self.current = self.rows, [], {}
        return rows


def _stamped(fn, label: str, stamps: Stamps):
    @functools.wraps(fn)
    def entry(*args, **kwargs):  # (a coroutine function's body starts when its caller awaits, at once)
        stamps.mark(label)
        return fn(*args, **kwargs)
    return entry


def install(stamps: Stamps) -> None:
    for label, module, attr in STAGES:
        owner = importlib.import_module(module)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, name, _stamped(getattr(owner, name), label, stamps))


def serve(cfg: str, port: int, out: str) -> None:
    """Run a gateway with every stage stamped; SIGUSR1 appends the requests seen since the last one to `out`."""
    stamps = Stamps()
    install(stamps)

    def dump(*_) -> None:
        with open(out, "a") as f:
            f.write(json.dumps(stamps.take()) + "\n")

    signal.signal(signal.SIGUSR1, dump)
    from gateway.cli.main import main
    main(["serve", "--config", cfg, "--port", str(port)])


# -- the run -------------------------------------------------------------------------------------
def stage_times(rows: list[dict[str, int]]) -> tuple[list[str], dict[str, list[float]]]:
    """The commonest order of stages among the requests, and for the requests in that order the microseconds from
    each stage's entry to the next one's."""
    orders: dict[tuple[str, ...], int] = {}
    for r in rows:
        key = tuple(sorted(r, key=r.__getitem__))
        orders[key] = orders.get(key, 0) + 1
    order = max(orders, key=orders.__getitem__)
    out: dict[str, list[float]] = {f"{a} → {b}": [] for a, b in zip(order, order[1:])}
    for r in rows:
        if tuple(sorted(r, key=r.__getitem__)) == order:
            for a, b in zip(order, order[1:]):
                out[f"{a} → {b}"].append((r[b] - r[a]) / 1000)
    return list(order), out


def wrapper_cost(n: int = 200_000) -> float:
    """Microseconds a stamp adds to one call (a wrapped no-op against a bare one, best of 5)."""
    stamps = Stamps()

    def noop() -> None:
        return None

    wrapped = _stamped(noop, "x", stamps)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            noop()
        t1 = time.perf_counter()
        for _ in range(n):
            wrapped()
        t2 = time.perf_counter()
        best = min(best, ((t2 - t1) - (t1 - t0)) / n * 1e6)
    return best


def client(url: str, kind: str, seconds: float) -> dict:
    out = subprocess.run(kit.script("peers_client.py", "--url", url, "--kind", kind, "--conc", "1", "--seconds",
                                    str(seconds), "--warmup", "1"), capture_output=True, text=True, check=True).stdout
    return json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[7:])


def measure(args) -> dict:
    cond = {**kit.provenance(), "command": kit.command("benchmarks.path_stages"),
            "seconds": args.seconds, "rounds": args.rounds, "stamp_cost_us": wrapper_cost()}
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        dump = tmp / "stamps.jsonl"
        procs: list[subprocess.Popen] = []
        try:
            cfg = kit.gateway_config(tmp / "gateway.toml", kit.start_engine(procs))
            port = kit.free_port()
            gw = kit.start([sys.executable, "-m", "benchmarks.path_stages", "--serve", str(cfg), "--port", str(port),
                            "--dump", str(dump)], procs, f"http://127.0.0.1:{port}/readyz", cwd=kit.ROOT, **kit.QUIET)
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            for rnd in range(args.rounds):
                for kind in ("nonstream", "stream") if rnd % 2 == 0 else ("stream", "nonstream"):
                    os.kill(gw.pid, signal.SIGUSR1)  # drops what came before (the warm-up, the other kind)
                    time.sleep(0.2)
                    seen = client(url, kind, args.seconds)
                    os.kill(gw.pid, signal.SIGUSR1)
                    time.sleep(0.3)
                    rows = json.loads(dump.read_text().splitlines()[-1])
                    order, times = stage_times(rows[len(rows) // 10:])  # the first tenth: still warming up
                    rounds.append({"round": rnd, "kind": kind, "order": order, "requests": len(rows),
                                   "in_order": len(next(iter(times.values()), [])),
                                   "stages": {k: statistics.median(v) for k, v in times.items()},
                                   "client_p50_us": seen["p50_us"], "client_ttft_p50_us": seen.get("ttft_p50_us")})
                    print(json.dumps(rounds[-1]), flush=True)
        finally:
            kit.stop_all(procs)
    cond["load_after"] = os.getloadavg()
    return {"conditions": cond, "rounds": rounds}


def markdown(data: dict) -> str:
    c = data["conditions"]
    lines = ["# Where a request's time goes inside the gateway, stage by stage", "",
             kit.run_line(c) + ".", "",
             "One gateway process (`benchmarks/overhead.py`'s config: API-key auth, JSON access log to /dev/null, "
             "stats upkeep, the default shape policy) in front of `benchmarks/fast_engine.py` (zero delay; a 16-token "
             "reply, or 200 events in one write); `benchmarks/peers_client.py` sends one request at a time for "
             f"{c['seconds']:g} s per kind and round, {c['rounds']} rounds, the kinds' order alternating. In the "
             "gateway process the entry to each stage's function is stamped (`time.perf_counter_ns`, the first entry "
             "of each request): a row is the wall time from one stage's entry to the next's, with the loop's turns and "
             "the system calls between them (the write to the engine opens 'upstream write', the first write to the "
             "client 'client write'). The first tenth of each round's requests is left out; of the rest, those "
             f"that met the stages in the commonest order are counted. A stamp adds {c['stamp_cost_us']:.2f} us to "
             "the call it wraps. Figures are medians of the rounds' medians (± = (max-min)/median).", ""]
    for kind, title in (("nonstream", "Non-streamed request"), ("stream", "Streamed request (200 events)")):
        rs = [r for r in data["rounds"] if r["kind"] == kind]
        if not rs:
            continue
        pairs = [p for p in rs[0]["stages"] if all(p in r["stages"] for r in rs)]
        lines += [f"## {title}", "", "| from → to | us | share of the path to the first client write |",
                  "|---|---|---|"]
        order = rs[0]["order"]
        first_write = order.index("client write") if "client write" in order else len(order) - 1
        on_path = {f"{a} → {b}" for a, b in zip(order[:first_write], order[1:first_write + 1])}
        path_total = statistics.median(sum(r["stages"][p] for p in on_path if p in r["stages"]) for r in rs)
        for p in pairs:
            m, spread = kit.median_spread([r["stages"][p] for r in rs])
            share = f"{m / path_total:.0%}" if p in on_path and path_total else "after it"
            lines.append(f"| {p} | {kit.pm((m, spread), ',.1f')} | {share} |")
        seen = [r["client_ttft_p50_us"] if kind == "stream" else r["client_p50_us"] for r in rs]
        engine = [r["stages"].get("upstream write → engine bytes in", 0.0) for r in rs]
        lines += ["", f"From the request's bytes to the first client write: {path_total:,.1f} us, of which the "
                  f"engine's answer (upstream write → engine bytes in) {statistics.median(engine):,.1f} us. The "
                  f"client saw {'a first token' if kind == 'stream' else 'a reply'} after "
                  f"{statistics.median(seen):,.0f} us (p50, its own clock). Requests counted per round: "
                  + ", ".join(f"{r['in_order']:,} of {r['requests']:,}" for r in rs) + ". The last stage's own "
                  "time is not in the table (nothing stamps its end).", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=4.0, help="per kind and round (default 4)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--render", action="store_true", help="re-render the .md from the saved .json")
    ap.add_argument("--serve", metavar="CONFIG", help=argparse.SUPPRESS)  # the stamped gateway itself
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--dump", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.dump)
        return
    kit.save_and_render("path_stages", None if args.render else measure(args), markdown)


if __name__ == "__main__":
    main()
