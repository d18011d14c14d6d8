"""The `shapegate` command: serve | sim | demo | keys."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import logging
import resource
import signal
import sys

from gateway.auth import hash_key, new_key
from gateway.config import ConfigError, load_config


async def serve_until_signal(cfg, host: str, port: int, config_path: str | None = None,
                             reuse_port: bool = False) -> None:
    """Run the gateway; SIGHUP reloads the config; SIGTERM/SIGINT stop accepting and let streams finish."""
    from gateway.app import build_app
    from gateway.front import start_serving
    from gateway.lifecycle import CUT_MARGIN_S, shutdown
    from gateway.pipeline import GATEWAY
    from gateway.reload import RELOADER

    app = build_app(cfg, config_path)
    grace = cfg.server.shutdown_grace_s
    try:
        front = await start_serving(app, host, port, reuse_port=reuse_port, shutdown_timeout=grace + CUT_MARGIN_S)
    except OSError as e:
        raise SystemExit(f"shapegate: cannot listen on {host}:{port}: {e.strerror or e}") from None
    logging.getLogger("shapegate").info("shapegate listening on http://%s:%d", host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, app[RELOADER].on_signal)
    await stop.wait()
    loop.remove_signal_handler(signal.SIGHUP)
    await shutdown(front, app[GATEWAY], grace)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"shapegate: {e}", file=sys.stderr)
        return 2
    import uvloop

    raise_file_limit()
    host = args.host or cfg.server.host
    port = args.port if args.port is not None else cfg.server.port
    if args.workers == 1:
        uvloop.run(serve_until_signal(cfg, host, port, args.config))
        return 0
    if port == 0:
        print("shapegate: --workers needs a fixed port (each worker binds it with SO_REUSEPORT)", file=sys.stderr)
        return 2
    from gateway.workers import run_workers

    def worker() -> int:
        uvloop.run(serve_until_signal(cfg, host, port, args.config, reuse_port=True))
        return 0

    return run_workers(args.workers, worker)


def raise_file_limit() -> None:
    """The soft limit on open files up to the hard one: every stream holds a client and an engine connection."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass  # some systems refuse an unlimited soft limit; the default stands and caps connections


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return n


def cmd_keys(args: argparse.Namespace) -> int:
    if args.keys_cmd == "new":
        key = new_key()
        print(f"key:    {key}\nsha256: {hash_key(key)}")
        print("Put the sha256 line in [[auth.keys]]; give the key to the client. It is not stored anywhere.",
              file=sys.stderr)
        return 0
    key = args.key
    if key is None:
        key = sys.stdin.readline().strip() if not sys.stdin.isatty() else getpass.getpass("API key: ")
    if not key:
        print("shapegate: empty key", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


def cmd_sim(args: argparse.Namespace) -> int:
    from gateway.sim import main as sim_main

    return sim_main.run(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from gateway import demo

    return demo.run(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shapegate", description="One OpenAI-compatible endpoint in front of vLLM, "
                                "SGLang and llama.cpp engines, routing each request by its shape.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("serve", help="run the gateway", description="Run the gateway from a TOML config file.")
    s.add_argument("--config", required=True, help="path to the TOML configuration (see config.example.toml)")
    s.add_argument("--host", default=None, help="listen address (default: [server] host)")
    s.add_argument("--port", type=int, default=None, help="listen port (default: [server] port)")
    s.add_argument("--workers", type=_positive, default=1,
                   help="gateway processes sharing the port (SO_REUSEPORT); /metrics adds up all of them")
    s.set_defaults(func=cmd_serve)

    k = sub.add_parser("keys", help="make API keys and their digests",
                       description="API keys are stored in config only as SHA-256 digests.")
    ks = k.add_subparsers(dest="keys_cmd", required=True, metavar="ACTION")
    kh = ks.add_parser("hash", help="print the sha256 digest of a key (argument, stdin, or prompt)")
    kh.add_argument("key", nargs="?", help="the key (omit to read it from stdin or a prompt)")
    ks.add_parser("new", help="generate a new random key and print it with its digest")
    k.set_defaults(func=cmd_keys)

    try:
        from gateway.sim import main as sim_main
    except ImportError:
        sim_main = None
    if sim_main is not None:
        sm = sub.add_parser("sim", help="run one simulated engine (vllm, sglang or llamacpp flavour)",
                            description="Run an OpenAI-compatible engine simulator with a latency model.")
        sim_main.add_arguments(sm)
        sm.set_defaults(func=cmd_sim)
        d = sub.add_parser("demo", help="start a simulated portfolio and the gateway in front of it",
                           description="Start three simulated engines and the gateway; Ctrl-C stops all.")
        d.add_argument("--port", type=int, default=8080, help="gateway port (default 8080)")
        d.add_argument("--host", default="127.0.0.1", help="gateway listen address")
        d.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
