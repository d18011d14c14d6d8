"""The CPU budget report: each concurrency gets its own table and reading from its own points, and a run saved before
concurrencies were asked for still renders as the c=64 run it was."""

from __future__ import annotations

from benchmarks import cpu_budget

CONDITIONS = {"date": "2026-12-04 04:00 UTC", "commit": "abc1234", "dirty_paths": [], "machine": "Test CPU, 2 cores",
              "load_before": [0.1, 0.2, 0.3], "load_after": [0.2, 0.2, 0.3],
              "command": "python3 benchmarks/cpu_budget.py", "seconds": 4.0, "repeats": 2, "wrk": "wrk 4.1.0"}


def point(target: str, rep: int, cpu: float, conc: int | None) -> dict:
    p = {"target": target, "rep": rep, "cpu_us": cpu, "user_us": cpu * 0.75, "sys_us": cpu * 0.25, "rps": 1e6 / cpu}
    if conc is not None:
        p["conc"] = conc
    return p


def run(concs: list[int | None], scale: dict) -> list[dict]:
    """Points for every target: the defaults cost `scale[conc]` us, all four off 20 us less, the parsing proxy 10."""
    out = []
    for conc in concs:
        base = scale[conc]
        for rep in (0, 1):
            out += [point("defaults", rep, base + rep, conc), point("all four off", rep, base - 20 + rep, conc),
                    point("parsing proxy", rep, 10.0 + rep, conc)]
    return out


def test_each_concurrency_has_its_own_table_and_reading():
    data = {"conditions": {**CONDITIONS, "concurrency": [64, 1], "build": "compiled"},
            "points": run([64, 1], {64: 40.0, 1: 100.0}),
            "syscalls": {"defaults@64": {"read": 2.0, "write": 2.0}, "defaults@1": {"read": 2.0, "epoll_wait": 1.0}}}
    text = cpu_budget.markdown(data)
    assert "compiled by `deploy/compile.py`" in text and "c=64, c=1; 2 threads, 1 at c=1" in text
    c64, c1 = text.split("## c=64", 1)[1].split("## c=1", 1)
    assert "| defaults | 40.5 (±2%)" in c64 and "| defaults | 100.5 (±1%)" in c1
    assert "all four off the gateway spends 20.5 us" in c64 and "all four off the gateway spends 80.5 us" in c1
    assert "epoll_wait" in c1 and "epoll_wait" not in c64
    assert "### Reading (c=64)" in c64 and "### Reading (c=1)" in c1


def test_a_run_saved_before_concurrencies_renders_as_c64():
    data = {"conditions": CONDITIONS, "points": run([None], {None: 40.0}),
            "syscalls": {"defaults": {"read": 2.0, "write": 2.1}}}
    text = cpu_budget.markdown(data)
    assert "(c=64; 2 threads)" in text and "the plain sources" in text
    assert "## c=" not in text and "## Reading" in text
    assert "| defaults | 40.5 (±2%) | 30.4 | 10.1 | 24,695 (±2%) | 4.10 (write 2.10, read 2.00) |" in text
