"""The `shapegate` command: serve | check | probe | ab | sim | demo | keys | usage."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import importlib.metadata
import logging
import os
import resource
import signal
import socket
import sys
from typing import NoReturn

from gateway.cli import ab as ab_report
from gateway.cli import keys as keys_client
from gateway.cli import usage as usage_client
from gateway.config import ConfigError, GatewayConfig, load_config
from gateway.keys.principal import hash_key, new_key


class Parser(argparse.ArgumentParser):
    """argparse's parser, but a usage error is one line on stderr (and exit 2), as every other refusal is."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def fail(message: str) -> SystemExit:
    """A refusal the user can act on: one line on stderr and exit status 2, never a traceback."""
    print(f"shapegate: {message}", file=sys.stderr)
    return SystemExit(2)


def read_config(path: str) -> GatewayConfig:
    """The configuration file, validated completely (policies included); SystemExit(2) with the reason if not."""
    from gateway.runtime import build_policy  # the gateway's own policies, which the file may name

    try:
        return load_config(path, build_policy)
    except ConfigError as e:
        raise fail(str(e)) from None


async def serve_until_signal(cfg, host: str, port: int, config_path: str | None = None,
                             reuse_port: bool = False) -> None:
    """Run the gateway; SIGHUP reloads the config; SIGTERM/SIGINT stop accepting and let streams finish."""
    from gateway.app import build_app, serve
    from gateway.ops.lifecycle import CUT_MARGIN_S, shutdown
    from gateway.ops.reload import RELOADER
    from gateway.runtime import GATEWAY

    try:
        app = build_app(cfg, config_path)
    except ValueError as e:  # a setting only checkable at start, e.g. the dashboard secret's variable
        raise fail(str(e)) from None
    grace = cfg.server.shutdown_grace_s
    try:
        front = await serve(app, host, port, reuse_port=reuse_port, shutdown_timeout=grace + CUT_MARGIN_S)
    except OSError as e:
        raise fail(f"cannot listen on {host}:{port}: {os_reason(e)}") from None
    logging.getLogger("shapegate").info("%s", start_line(cfg, host, front.port))
    stop = asyncio.Event()
    got: list[str] = []
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda name=sig.name: (got.append(name), stop.set()))
    loop.add_signal_handler(signal.SIGHUP, app[RELOADER].on_signal)
    await stop.wait()
    loop.remove_signal_handler(signal.SIGHUP)
    await shutdown(front, app[GATEWAY], grace, got[0] if got else "asked to stop")


def start_line(cfg: GatewayConfig, host: str, port: int) -> str:
    """What serve says once it listens: where, in front of what, with which policy and state."""
    from gateway.keys.keystore import where_kept

    shown = "; ".join(f"{b.id} ({b.engine} at {b.url}: {', '.join(b.models)})" for b in cfg.backends)
    keys = f"; run-time keys are kept {where_kept(cfg)}" if cfg.auth.enabled else "; auth disabled"
    return (f"shapegate listening on http://{host}:{port} (pid {os.getpid()}), routing policy {cfg.routing.policy}, "
            f"state {cfg.state.backend}; {len(cfg.backends)} backend(s): {shown}{keys}")


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = keys_place(read_config(args.config), args.config, args.ephemeral_keys)
    check_keys_file(cfg)
    import uvloop

    raise_file_limit()
    host = args.host or cfg.server.host
    port = args.port if args.port is not None else cfg.server.port
    if args.workers == 1:
        uvloop.run(serve_until_signal(cfg, host, port, args.config))
        return 0
    if port == 0:
        raise fail("--workers needs a fixed port (each worker binds it with SO_REUSEPORT)")
    check_listen(host, port)  # a taken port is one line here, not one refusal per worker
    if cfg.responses.state == "gateway" and cfg.state.backend == "memory":
        logging.getLogger("shapegate").warning(
            "stored responses and conversations are kept in each worker's memory: a chain continues only on the "
            "worker that recorded it; set [state] backend = \"redis\" so that %d workers share them", args.workers)
    from gateway.ops.workers import run_workers

    def worker() -> int:
        uvloop.run(serve_until_signal(cfg, host, port, args.config, reuse_port=True))
        return 0

    return run_workers(args.workers, worker)


def keys_place(cfg: GatewayConfig, config_path: str, ephemeral: bool) -> GatewayConfig:
    """Run-time keys persist by default: with neither Redis nor [auth] keys_file, in a file beside the configuration;
    where that place is not safe or not writable, serve refuses to start unless told to keep them in memory."""
    from gateway.keys.keystore import default_keys_file, keeping_keys_in, needs_keys_place

    if ephemeral or not needs_keys_place(cfg):
        return cfg
    path = default_keys_file(config_path)
    try:
        return keeping_keys_in(cfg, path)
    except ValueError as e:
        raise fail(f"{e}. Keys made at run time (POST /admin/keys) are kept there when neither [state] backend = "
                   f"\"redis\" nor [auth] keys_file says where: set [auth] keys_file to a private place, or pass "
                   f"--ephemeral-keys to keep them in memory only (lost when the gateway stops)") from None


def check_keys_file(cfg: GatewayConfig) -> None:
    """A keys file in a place another local user could change is refused before any worker starts (exit 2)."""
    if cfg.auth.keys_file and cfg.state.backend != "redis":
        from gateway.keys.storage import FileKeys

        try:
            FileKeys(cfg.auth.keys_file)
        except ValueError as e:
            raise fail(str(e)) from None


def os_reason(e: OSError) -> str:
    """The system's short reason ("Address already in use"): asyncio wraps it in a longer sentence."""
    if e.errno and not isinstance(e, socket.gaierror):
        return os.strerror(e.errno)
    return e.strerror or str(e)


def check_listen(host: str, port: int) -> None:
    """Bind host:port as the workers will (SO_REUSEPORT), then let go; SystemExit(2) if that is refused."""
    try:
        for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                               flags=socket.AI_PASSIVE):
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                s.bind(addr)
    except OSError as e:
        raise fail(f"cannot listen on {host}:{port}: {os_reason(e)}") from None


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
    if args.keys_cmd in ("create", "list", "revoke"):
        return keys_client.run(args)
    if args.keys_cmd == "new":
        key = new_key()
        digest = hash_key(key)
        # The block alone on stdout (`>> config.toml` appends it whole); the key on stderr, never into a file.
        limits = {name: getattr(args, name) for name in keys_client.LIMIT_NAMES if getattr(args, name) is not None}
        print(keys_client.config_block(args.id or f"key-{digest[:8]}", digest, args.admin, limits))
        print(f"key: {key}\nGive the key to its client: it is stored nowhere, the configuration holds only its "
              "sha256.", file=sys.stderr)
        return 0
    key = args.key
    if key is None:
        key = sys.stdin.readline().strip() if not sys.stdin.isatty() else getpass.getpass("API key: ")
    if not key:
        print("shapegate: empty key", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from gateway.cli import check

    cfg = read_config(args.config)
    return check.run(cfg, args.config, args.timeout, args.allow_missing)


def cmd_probe(args: argparse.Namespace) -> int:
    from gateway.cli import probe

    cfg = read_config(args.config)
    return probe.run(cfg, args.timeout or cfg.probe.timeout_s, args.json)


def _port(text: str) -> int:
    n = int(text)
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError("must be a port number, 0 to 65535 (0: any free one)")
    return n


def _seconds(text: str) -> float:
    t = float(text)
    if not t > 0:
        raise argparse.ArgumentTypeError("must be more than 0")
    return t


def version() -> str:
    try:
        return importlib.metadata.version("shapegate")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def cmd_sim(args: argparse.Namespace) -> int:
    from gateway.sim import main as sim_main

    return sim_main.run(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from gateway.cli import demo

    try:
        return demo.run(args)
    except demo.CannotListen as e:
        raise fail(f"cannot listen on {args.host}:{args.port}: {os_reason(e.error)} (--port picks another)") from None


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="shapegate", description="One OpenAI-compatible endpoint in front of vLLM, "
               "SGLang and llama.cpp engines, routing each request by its shape.")
    p.add_argument("--version", action="version", version=f"shapegate {version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("serve", help="run the gateway", description="Run the gateway from a TOML config file.")
    s.add_argument("--config", required=True, help="path to the TOML configuration (see config.example.toml)")
    s.add_argument("--host", default=None, help="listen address (default: [server] host)")
    s.add_argument("--port", type=_port, default=None, help="listen port (default: [server] port)")
    s.add_argument("--workers", type=_positive, default=1,
                   help="gateway processes sharing the port (SO_REUSEPORT); /metrics adds up all of them")
    s.add_argument("--ephemeral-keys", action="store_true",
                   help="keep keys made at run time in memory only (lost on stop) rather than in a file beside the "
                        "configuration, when neither Redis nor [auth] keys_file is configured")
    s.set_defaults(func=cmd_serve)

    c = sub.add_parser("check", help="validate a config file and ask each backend once what it serves",
                       description="Validate the configuration as serve does (exit 2 if invalid), then probe "
                                   "each backend once: health, listed models, context window. Exit 1 when a "
                                   "backend does not answer or its engine does not list a model it is "
                                   "configured with (--allow-missing: 0, the problems still reported).")
    c.add_argument("--config", required=True, help="path to the TOML configuration")
    c.add_argument("--timeout", type=_seconds, default=10.0, help="seconds per engine request (default 10)")
    c.add_argument("--allow-missing", action="store_true",
                   help="exit 0 even when a backend does not answer or does not list a configured model")
    c.set_defaults(func=cmd_check)

    pr = sub.add_parser("probe", help="ask each backend's engine which APIs and chat features it serves per model",
                        description="Validate the configuration (exit 2 if invalid), then try each API and chat "
                                    "feature on each backend's engine directly, with a tiny request, for each "
                                    "model it serves, and print the support matrix with the reason of every no. "
                                    "Exit 0 when the checks [probe] require pass everywhere, else 1.")
    pr.add_argument("--config", required=True, help="path to the TOML configuration")
    pr.add_argument("--json", action="store_true", help="print the matrix as JSON")
    pr.add_argument("--timeout", type=_seconds, default=None,
                    help="seconds per check (default: [probe] timeout_s)")
    pr.set_defaults(func=cmd_probe)
    ab_report.add_parser(sub)  # `shapegate ab`: the verdicts of a running gateway's experiments

    k = sub.add_parser("keys", help="make API keys and their digests; manage a running gateway's keys",
                       description="API keys are stored only as SHA-256 digests: in the configuration file "
                                   "(new, hash) or, made at run time, by the gateway (create, list, revoke).")
    ks = k.add_subparsers(dest="keys_cmd", required=True, metavar="ACTION")
    kh = ks.add_parser("hash", help="print the sha256 digest of a key (argument, stdin, or prompt)")
    kh.add_argument("key", nargs="?", help="the key (omit to read it from stdin or a prompt)")
    kn = ks.add_parser("new", help="generate a new random key; print its [[auth.keys]] block (the key: stderr)",
                       description="Make a random API key. Its [[auth.keys]] block, ready to paste into the "
                                   "configuration, goes to stdout; the key itself to stderr, shown once.")
    kn.add_argument("--id", help="the key's id in the block (default: key- and the start of its digest)")
    kn.add_argument("--admin", action="store_true", help="admin = true in the block")
    for name, what in (("rpm", "requests per minute"), ("tpm", "tokens per minute"),
                       ("tokens-per-day", "tokens per UTC day (a quota)"),
                       ("tokens-per-month", "tokens per UTC month (a quota)")):
        kn.add_argument(f"--{name}", type=int, help=f"{what}: the block's limits")
    keys_client.add_parsers(ks)
    k.set_defaults(func=cmd_keys)
    usage_client.add_parser(sub)  # `shapegate usage`: a running gateway's usage ledger

    from gateway.sim import main as sim_main  # part of the package: the simulator and the demo always exist

    sm = sub.add_parser("sim", help="run one simulated engine (vllm, sglang or llamacpp flavour)",
                        description="Run an OpenAI-compatible engine simulator with a latency model.")
    sim_main.add_arguments(sm)
    sm.set_defaults(func=cmd_sim)
    d = sub.add_parser("demo", help="start a simulated portfolio and the gateway in front of it",
                       description="Start three simulated engines and the gateway; Ctrl-C stops all.")
    d.add_argument("--port", type=_port, default=8080, help="gateway port (default 8080; 0: any free one)")
    d.add_argument("--host", default="127.0.0.1", help="gateway listen address")
    d.add_argument("--ab", action="store_true", help="also run an A/B experiment: vLLM against SGLang")
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        args = build_parser().parse_args(argv)
        status = args.func(args)
        sys.stdout.flush()  # a reader that went away shows here, where it is handled, not at the interpreter's exit
        return status
    except SystemExit:  # --help, --version, a refusal: their output is flushed here too
        _quiet_flush()
        raise
    except BrokenPipeError:
        _quiet_stdout()
        return 1


def _quiet_stdout() -> None:
    """The reader of stdout went away (`shapegate check ... | head -1`): nothing more can be said there, and the
    interpreter's last flush must not fail again, so stdout goes to /dev/null; no traceback."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def _quiet_flush() -> None:
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _quiet_stdout()


if __name__ == "__main__":
    sys.exit(main())
