"""What the gateway adds: the same wrk load against an engine directly and through the gateway, in one run."""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import urllib.request

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
KEY = "sk-bench-key"

WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = os.getenv("BODY")
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer %s"
done = function(summary, latency, requests)
  io.write(string.format("JSON{\\"requests\\":%%d,\\"errors\\":%%d,\\"duration_us\\":%%d,\\"p50\\":%%d,\\"p99\\":%%d}\\n",
    summary.requests, summary.errors.status + summary.errors.connect + summary.errors.read +
    summary.errors.write + summary.errors.timeout, summary.duration,
    latency:percentile(50), latency:percentile(99)))
end
""" % KEY

BODIES = {
    "nonstream": json.dumps({"model": "bench", "messages": [{"role": "user", "content": "hello there"}],
                             "max_tokens": 16}),
    "stream": json.dumps({"model": "bench", "messages": [{"role": "user", "content": "hello there"}],
                          "max_tokens": 200, "stream": True, "stream_options": {"include_usage": True}}),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(url)
        time.sleep(0.1)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_wrk(url: str, body: str, conc: int, seconds: float, script: str) -> dict:
    threads = 1 if conc == 1 else 2
    out = subprocess.run(["wrk", f"-t{threads}", f"-c{conc}", f"-d{seconds:g}s", "-s", script, url],
                         capture_output=True, text=True, env={**os.environ, "BODY": body}, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("JSON"))
    return json.loads(line[4:])


def start_stack(tmp: Path, stats: bool) -> tuple[list[subprocess.Popen], dict]:
    engine_port, gw_port = free_port(), free_port()
    engine = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "fast_engine.py"), "--port",
                               str(engine_port)])
    from gateway.auth import hash_key
    cfg = tmp / "bench.toml"
    cfg.write_text(f"""
[server]
access_log = {str(stats).lower()}
[[auth.keys]]
id = "bench"
sha256 = "{hash_key(KEY)}"
[health]
warmup = false
[[backends]]
id = "engine"
engine = "openai"
url = "http://127.0.0.1:{engine_port}"
models = ["bench"]
""")
    gw = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg), "--port",
                           str(gw_port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    floor_port = free_port()
    floor = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "floor_proxy.py"), "--port", str(floor_port),
                              "--upstream", f"http://127.0.0.1:{engine_port}"], stderr=subprocess.DEVNULL)
    wait_http(f"http://127.0.0.1:{engine_port}/health")
    wait_http(f"http://127.0.0.1:{gw_port}/readyz")
    wait_http(f"http://127.0.0.1:{floor_port}/readyz")
    targets = {"direct": (f"http://127.0.0.1:{engine_port}", None), "gateway": (f"http://127.0.0.1:{gw_port}", gw.pid),
               "floor": (f"http://127.0.0.1:{floor_port}", floor.pid)}
    return [engine, gw, floor], targets


def measure(args) -> dict:
    results: dict = {"conditions": {}, "points": []}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        script = tmp / "post.lua"
        script.write_text(WRK_SCRIPT)
        procs, targets = start_stack(tmp, stats=True)
        try:
            for kind in args.kinds:
                for conc in args.concurrency:
                    for rep in range(args.repeats):
                        for target, (base, pid) in targets.items():
                            url = base + "/v1/chat/completions"
                            c0 = cpu_seconds(pid) if pid else 0.0
                            r = run_wrk(url, BODIES[kind], conc, args.seconds, str(script))
                            cpu = (cpu_seconds(pid) - c0) if pid else 0.0
                            r.update(kind=kind, conc=conc, rep=rep, target=target,
                                     rps=r["requests"] / (r["duration_us"] / 1e6),
                                     gw_cpu_per_req_us=(cpu / r["requests"] * 1e6) if pid else None)
                            results["points"].append(r)
                            print(json.dumps(r), flush=True)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(10)
    return results


def med_spread(values: list[float]) -> tuple[float, float]:
    m = statistics.median(values)
    return m, (max(values) - min(values)) / m * 100 if m else 0.0


def summarize(results: dict, chunks: int) -> str:
    pts = results["points"]
    lines = ["| kind | conc | direct p50 us | gateway p50 us | added p50 us | added p99 us | direct req/s | "
             "gateway req/s | ratio | gateway CPU/req us | floor CPU/req us | floor req/s | chunks/s via gateway |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(p["kind"], p["conc"]) for p in pts}, key=lambda k: (k[0] != "nonstream", k[1]))
    for kind, conc in keys:
        d = [p for p in pts if p["kind"] == kind and p["conc"] == conc and p["target"] == "direct"]
        g = [p for p in pts if p["kind"] == kind and p["conc"] == conc and p["target"] == "gateway"]
        dp50, _ = med_spread([p["p50"] for p in d])
        gp50, gs = med_spread([p["p50"] for p in g])
        add50, _ = med_spread([gp["p50"] - dp["p50"] for gp, dp in zip(g, d)])
        add99, _ = med_spread([gp["p99"] - dp["p99"] for gp, dp in zip(g, d)])
        drps, _ = med_spread([p["rps"] for p in d])
        grps, grs = med_spread([p["rps"] for p in g])
        cpu, cs = med_spread([p["gw_cpu_per_req_us"] for p in g])
        f = [p for p in pts if p["kind"] == kind and p["conc"] == conc and p["target"] == "floor"]
        fcpu, _ = med_spread([p["gw_cpu_per_req_us"] for p in f]) if f else (0.0, 0.0)
        frps, _ = med_spread([p["rps"] for p in f]) if f else (0.0, 0.0)
        events = chunks + 3 if kind == "stream" else 0
        relayed = f"{grps * events:,.0f}" if kind == "stream" else "-"
        lines.append(f"| {kind} | {conc} | {dp50:.0f} | {gp50:.0f} (±{gs:.0f}%) | {add50:.0f} | {add99:.0f} | "
                     f"{drps:,.0f} | {grps:,.0f} (±{grs:.0f}%) | {grps / drps:.2f} | {cpu:.0f} (±{cs:.0f}%) | "
                     f"{fcpu:.0f} | {frps:,.0f} | {relayed} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--kinds", nargs="+", default=["nonstream", "stream"])
    p.add_argument("--out", default=str(RESULTS / "overhead"))
    args = p.parse_args()
    results = measure(args)
    results["conditions"] = {"seconds": args.seconds, "repeats": args.repeats, "cpus": os.cpu_count(),
                             "load": "wrk on the same machine", "engine": "benchmarks/fast_engine.py",
                             "stream_chunks": 200, "date": time.strftime("%Y-%m-%d %H:%M")}
    table = summarize(results, 200)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    out.with_suffix(".md").write_text(f"# Gateway overhead\n\nMedians of {args.repeats} runs of {args.seconds:g} s "
                                      f"(spread = (max-min)/median), wrk, gateway and engine on the same "
                                      f"{os.cpu_count()} cores. Latencies in microseconds.\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
