"""The peers benchmark's load client, fake engine and CPU accounting against real processes on loopback."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import pytest

from benchmarks import kit, peers_targets
from benchmarks.loopback import free_port
from benchmarks.peers_client import has_content

EVENTS_PER_STREAM = 203  # role, 200 tokens, finish, usage ([DONE] is not an event the client counts)


@pytest.fixture
def engine() -> Iterator[str]:
    procs: list[subprocess.Popen] = []
    try:
        yield kit.start_engine(procs)
    finally:
        kit.stop_all(procs)


def run_client(url: str, kind: str, conc: int = 4, *more: str) -> tuple[list[str], dict]:
    out = subprocess.run(kit.script("peers_client.py", "--url", url + "/v1/chat/completions", "--kind", kind, "--conc",
                                    str(conc), "--seconds", "0.4", "--warmup", "0.1", *more),
                         capture_output=True, text=True, timeout=60, check=True).stdout
    lines = out.splitlines()
    return lines, json.loads(lines[-1].removeprefix("RESULT "))


def test_streams_are_counted_with_their_tokens_and_first_token(engine: str) -> None:
    lines, r = run_client(engine, "stream")
    assert lines[:2] == ["measure", "stop"]  # the window's edges come before the result
    assert r["requests"] > 0 and r["errors"] == 0
    assert r["tokens_min"] == r["tokens_max"] == 200 and r["tokens"] == 200 * r["requests"]
    assert r["events"] == EVENTS_PER_STREAM * r["requests"]
    assert 0 < r["ttft_p50_us"] <= r["p50_us"] and r["ttft_p99_us"] <= r["p99_us"]


def test_a_rate_spaces_the_requests_out_over_the_workers(engine: str) -> None:
    # 50 a second from 4 workers: the 0.4 s window holds 20 turns (the engine answers in well under their 20 ms
    # spacing); without a rate the same workers finish thousands in it.
    _, r = run_client(engine, "stream", 4, "--rate", "50")
    assert r["rate"] == 50 and r["errors"] == 0 and r["tokens_min"] == 200
    assert 1 <= r["requests"] <= 21, r["requests"]
    assert r["late_starts"] <= r["requests"]


def test_non_streamed_requests_have_latency_and_no_tokens(engine: str) -> None:
    _, r = run_client(engine, "nonstream", conc=2)
    assert r["requests"] > 0 and r["errors"] == 0
    assert 0 < r["p50_us"] <= r["p99_us"] and r["ttft_p50_us"] is None and r["tokens"] == 0


def test_a_target_that_refuses_connections_gives_errors_not_figures() -> None:
    _, r = run_client(f"http://127.0.0.1:{free_port()}", "nonstream", conc=1)
    assert r["requests"] == 0 and r["errors"] > 0 and r["p50_us"] is None
    assert all(kind.startswith("connect:") for kind in r["error_kinds"])


def test_fast_engine_answers_what_routers_read_when_they_add_it(engine: str) -> None:
    with urllib.request.urlopen(engine + "/v1/models", timeout=5) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == ["bench"]
    with urllib.request.urlopen(engine + "/server_info", timeout=5) as r:
        info = json.loads(r.read())
    assert info["served_model_name"] == "bench" and "model_path" not in info  # no tokenizer to load
    port = int(engine.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:  # an HTTP/2 probe is refused at once
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        assert s.recv(100) == b""


def test_has_content_skips_the_role_event() -> None:
    assert not has_content(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}')
    assert has_content(b'data: {"choices":[{"delta":{"content": "tok0 "}}]}')
    assert not has_content(b'data: {"choices":[],"usage":{"total_tokens":3}}')


def test_cpu_of_a_target_includes_its_child_processes() -> None:
    # The child burns 0.3 s of CPU time (measured by its own clock), then waits: the parent itself does nothing.
    child = "import sys, time\nwhile time.process_time() < 0.3: pass\nprint('done', flush=True)\nsys.stdin.read()"
    parent = (f"import subprocess, sys\np = subprocess.Popen([sys.executable, '-c', {child!r}], stdin=sys.stdin)\n"
              "p.wait()")
    with subprocess.Popen([sys.executable, "-c", parent], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            assert proc.stdout.readline().strip() == "done"
            assert peers_targets.tree_cpu(proc.pid) >= 0.25  # /proc counts whole clock ticks
            assert peers_targets.tree_shape(proc.pid)["processes"] == 2
        finally:
            proc.stdin.close()  # the child's read ends, then both exit
