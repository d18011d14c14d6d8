"""Command line of the engine simulator: `shapegate sim --engine vllm|sglang|llamacpp ...`."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys

import uvloop

from gateway.sim.faults import FaultSpec
from gateway.sim.options import SimOptions
from gateway.sim.profiles import ENGINES, load_profiles
from gateway.sim.runner import start_sim


def _port(text: str) -> int:
    n = int(text)
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError("must be a port number, 0 to 65535 (0: any free one)")
    return n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the simulator's flags to a (sub)parser."""
    parser.add_argument("--engine", required=True, choices=ENGINES, help="engine flavour to simulate")
    parser.add_argument("--host", default="127.0.0.1")
    # Not the engine's usual port: llama-server's 8080 is the gateway's too, and a second sim would clash.
    parser.add_argument("--port", type=_port, default=0,
                        help="listen port (default: a free one, printed with the URL at start)")
    parser.add_argument("--model", default="sim-model", help="served model name")
    parser.add_argument("--served-model-name", dest="aliases", nargs="+", default=[],
                        metavar="NAME", help="more names the engine answers to")
    parser.add_argument("--profile", default=None,
                        help=f"latency profile (default: the engine's fast one); "
                             f"known: {', '.join(sorted(load_profiles()))}")
    parser.add_argument("--slots", type=int, default=None,
                        help="llama.cpp slots (-np); vLLM/SGLang max running requests")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated text")
    parser.add_argument("--warmup", type=float, default=0.0, metavar="SECONDS",
                        help="start-up time: vLLM refuses connections, SGLang /health is 503, "
                             "llama.cpp answers 503 Loading model")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length override (llama.cpp: per slot)")
    parser.add_argument("--report-cached-tokens", action="store_true",
                        help="usage.prompt_tokens_details.cached_tokens (vLLM/SGLang opt-in flag)")
    parser.add_argument("--responses-store", dest="responses_store", default=None,
                        action=argparse.BooleanOptionalAction,
                        help="keep `store: true` Responses-API responses (default: the engine's own: "
                             "vLLM off, as without VLLM_ENABLE_RESPONSES_API_STORE=1; SGLang on)")
    parser.add_argument("--serves", nargs="+", default=[], metavar="API",
                        help="APIs the simulated model serves besides text: embeddings, rerank, score, "
                             "transcriptions, translations (each flavour those its engine has); without them "
                             "it refuses them as the engine does for a text model")
    faults = parser.add_argument_group("fault knobs (also at run time: POST /sim/faults)")
    faults.add_argument("--fault-error-rate", type=float, default=0.0, metavar="P")
    faults.add_argument("--fault-error-status", type=int, default=500, metavar="STATUS")
    faults.add_argument("--fault-retry-after", type=float, default=None, metavar="SECONDS")
    faults.add_argument("--fault-hang", type=float, default=0.0, metavar="SECONDS",
                        help="wait before the first byte (negative: until the client leaves)")
    faults.add_argument("--fault-slow-start", type=float, default=0.0, metavar="SECONDS")
    faults.add_argument("--fault-drop-after", type=int, default=None, metavar="CHUNKS")
    faults.add_argument("--fault-error-after", type=int, default=None, metavar="CHUNKS")
    faults.add_argument("--fault-unhealthy", action="store_true")


def options_from_args(args: argparse.Namespace) -> SimOptions:
    """SimOptions from parsed flags (raises ValueError on a bad combination)."""
    try:
        faults = FaultSpec(
            error_rate=args.fault_error_rate, error_status=args.fault_error_status,
            retry_after_s=args.fault_retry_after, hang_s=args.fault_hang,
            slow_start_s=args.fault_slow_start, drop_after_chunks=args.fault_drop_after,
            error_after_chunks=args.fault_error_after, unhealthy=args.fault_unhealthy)
    except ValueError as exc:
        raise ValueError(f"invalid fault flags: {exc}") from exc
    opts = SimOptions(
        engine=args.engine, model=args.model, profile=args.profile, slots=args.slots,
        seed=args.seed, host=args.host, port=args.port, warmup_s=args.warmup, faults=faults,
        served_model_names=tuple(args.aliases), max_model_len=args.max_model_len,
        report_cached_tokens=args.report_cached_tokens, responses_store=args.responses_store,
        serves=frozenset(args.serves))
    opts.resolve_profile()
    return opts


async def _serve(opts: SimOptions) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = await start_sim(opts)
    try:
        profile = server.state.profile.name
        print(f"shapegate sim: {opts.engine} ({profile}) on {server.url}"
              + (f", warming up for {opts.warmup_s:g} s" if opts.warmup_s > 0 else ""), flush=True)
        stopped = asyncio.ensure_future(stop.wait())
        ready = asyncio.ensure_future(server.wait_ready())
        await asyncio.wait({stopped, ready}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            ready.result()  # a vLLM-style late bind that failed raises here
        else:
            ready.cancel()
        await stopped
    finally:
        await server.close()


def run(args: argparse.Namespace) -> int:
    """Run one simulated engine until SIGINT/SIGTERM; returns the exit status."""
    try:
        opts = options_from_args(args)
    except ValueError as exc:
        print(f"shapegate sim: {exc}", file=sys.stderr)
        return 2
    try:
        uvloop.run(_serve(opts))
    except OSError as exc:
        print(f"shapegate sim: cannot listen on {opts.host}:{opts.port}: {_os_reason(exc)}", file=sys.stderr)
        return 2
    return 0


def _os_reason(e: OSError) -> str:
    """The system's short reason ("Address already in use"), not asyncio's sentence around it."""
    if e.errno and not isinstance(e, socket.gaierror):
        return os.strerror(e.errno)
    return e.strerror or str(e)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shapegate sim", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
