"""The command line: flags to options, bad combinations, and `python -m gateway.sim` as a process."""

import argparse
import asyncio
import signal
import sys
import time

import aiohttp
import pytest

from gateway.sim.main import add_arguments, options_from_args, run


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_become_options():
    opts = options_from_args(parse(
        "--engine", "llamacpp", "--port", "0", "--model", "m", "--served-model-name", "a", "b",
        "--profile", "r9700-llamacpp-hip", "--slots", "2", "--seed", "7", "--warmup", "1.5",
        "--fault-error-rate", "0.25", "--fault-error-status", "503", "--fault-retry-after", "3",
        "--fault-drop-after", "5", "--fault-unhealthy"))
    assert (opts.engine, opts.port, opts.model, opts.seed, opts.warmup_s) == ("llamacpp", 0, "m", 7, 1.5)
    assert opts.model_names == ("m", "a", "b")
    assert opts.resolve_profile().max_running == 2
    f = opts.faults
    assert (f.error_rate, f.error_status, f.retry_after_s, f.drop_after_chunks, f.unhealthy) == (
        0.25, 503, 3, 5, True)


def test_default_port_is_a_free_one():
    # Not the engine's usual port: llama-server's 8080 is the gateway's (the process prints the one it got).
    for engine in ("vllm", "sglang", "llamacpp"):
        assert options_from_args(parse("--engine", engine)).port == 0
    assert options_from_args(parse("--engine", "vllm")).profile is None


@pytest.mark.parametrize("argv", [
    ("--engine", "vllm", "--profile", "mi350x-sglang"),
    ("--engine", "vllm", "--profile", "no-such-profile"),
    ("--engine", "vllm", "--fault-error-rate", "3"),
    ("--engine", "llamacpp", "--slots", "0"),
])
def test_bad_combinations_exit_2(argv, capsys):
    assert run(parse(*argv)) == 2
    assert "shapegate sim:" in capsys.readouterr().err


async def test_module_entry_point_serves_and_stops_on_sigterm():
    start = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.sim", "--engine", "sglang",  # no --port: a free one, printed
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 10)).decode()
        startup = time.perf_counter() - start
        url = line.strip().rsplit(" ", 1)[-1]
        assert line.startswith("shapegate sim: sglang (tiny-sglang) on http://127.0.0.1:")
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/ping") as resp:
                assert resp.status == 200
        # Start-up is well under a second on an idle machine; allow for a busy one here.
        assert startup < 3.0, startup
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    assert await proc.stderr.read() == b""


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llamacpp"])
async def test_start_sim_is_well_under_a_second(sim, http, engine):
    start = time.perf_counter()
    server = await sim(engine)
    async with http.get(server.url + "/health") as resp:
        assert resp.status == 200
    assert time.perf_counter() - start < 1.0
