"""deploy/compose.yaml without a container engine: its services as local processes, same configs, ports and replicas."""

# python3 -m deploy.run_local [--ports free] [--key-prefix P] [--status-file F]   (from the repository's root)
# Reads the compose file itself (commands, ports, environment, health checks, stop grace), so it cannot drift
# from it. Differences that follow from one machine: every service listens on 127.0.0.1; a service reached
# by name on the compose network is reached at its local port (the mounted gateway config is rendered so);
# Redis is the machine's when one answers on the compose's port, else one started here on a free port.
# SIGHUP re-renders the gateway configs and passes the signal on (`docker compose kill -s SIGHUP`); SIGINT or
# SIGTERM stops every process started here, dependents first, each within its stop_grace_period.
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import aiohttp

DEPLOY_EXTRA = "pip install -e '.[deploy]'"
try:
    import yaml  # deploy.compose_plan reads the compose file with it: not a dependency of the gateway itself
except ModuleNotFoundError:
    if __name__ != "__main__":
        raise
    print(f"run_local: PyYAML is needed to read deploy/compose.yaml: {DEPLOY_EXTRA}", file=sys.stderr)
    sys.exit(2)

from deploy.compose_plan import (COMPOSE, DEMO_KEYS, LOCAL_HOST, ROOT,  # noqa: E402 (after the check above)
                                 ComposeError, Service, free_port, listen_port, load_compose, local_argv, local_ports,
                                 render_config, services, start_order)
from gateway.cli.main import Parser
from gateway.config import ConfigError, load_config
from gateway.runtime import build_policy

START_TIMEOUT_S = 60.0


class Stack:
    """The processes of one compose file, started in dependency order."""

    def __init__(self, compose: Path, free: bool, key_prefix: str | None) -> None:
        self.compose = compose
        self.svcs = services(load_compose(compose), compose.parent)
        self.order = start_order(self.svcs)
        self.ports = local_ports(self.svcs, free)
        self.inside = {name: listen_port(s) for name, s in self.svcs.items()}  # read once: a reload keeps ports
        self.free = free
        self.key_prefix = key_prefix
        self.workdir = Path(tempfile.mkdtemp(prefix="shapegate-stack-"))
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.pumps: list[asyncio.Task] = []
        self.redis_started = False
        self.configs: dict[str, tuple[Path, Path]] = {}  # service -> (source file, rendered file)

    # -- configs ------------------------------------------------------------------------------------
    def render(self, name: str) -> Path | None:
        """Render the service's mounted --config for this machine and check it as `shapegate check` does."""
        s = self.svcs[name]
        inside = s.option("--config")
        if inside is None:
            return None
        source = s.host_path(inside)
        target = self.workdir / name / source.name
        target.parent.mkdir(exist_ok=True)
        tmp = target.with_suffix(".tmp")
        addresses = {n: (self.inside[n], self.ports[n]) for n in self.svcs}
        tmp.write_text(render_config(source.read_text(), addresses, self.key_prefix))
        try:
            cfg = load_config(tmp, build_policy)
        except ConfigError as e:
            raise ComposeError(f"{name}: {source}: {e}") from None
        unresolved = [u for u in (*(b.url for b in cfg.backends), cfg.state.redis_url) if f"//{LOCAL_HOST}:" not in u]
        if unresolved:
            raise ComposeError(f"{name}: no service of {self.compose.name} listens at {', '.join(unresolved)}")
        os.replace(tmp, target)  # whole, for a reload that reads it
        self.configs[name] = (source, target)
        return target

    # -- processes ----------------------------------------------------------------------------------
    async def _redis(self, s: Service) -> None:
        """The machine's Redis if one answers on the compose's port (never stopped here), else our own."""
        port = self.inside[s.name]
        if await redis_answers(port):
            self.ports[s.name] = port
            return
        if shutil.which(s.command[0] if s.command else "redis-server") is None:
            raise ComposeError(f"no Redis answers on {LOCAL_HOST}:{port} and redis-server is not installed")
        self.ports[s.name] = free_port()
        # Its files (the compose asks for an append-only file) in the stack's directory, not the repository's:
        # a stack run here is a test run, and its Redis goes with it.
        data = self.workdir / s.name
        data.mkdir(exist_ok=True)
        await self._spawn(s, [*local_argv(s, self.ports[s.name], None), "--dir", str(data)])
        self.redis_started = True

    async def _spawn(self, s: Service, argv: list[str]) -> None:
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=ROOT, env={**os.environ, **s.environment}, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
            limit=1 << 20)  # a line of output may be long (a traceback's, an access log's)
        self.procs[s.name] = proc
        self.pumps.append(asyncio.create_task(pump(s.name, proc), name=f"log-{s.name}"))

    async def start(self) -> None:
        for name in self.order:
            s = self.svcs[name]
            if s.kind == "redis":
                await self._redis(s)
                if self.redis_started:
                    await until(partial(redis_answers, self.ports[name]), f"{name} (redis-server)", self.procs[name])
                continue
            await self._spawn(s, local_argv(s, self.ports[name], self.render(name)))
            if s.health_path is not None:
                url = f"http://{LOCAL_HOST}:{self.ports[name]}{s.health_path}"
                await until(partial(http_ok, url), f"{name} ({url})", self.procs[name])

    def reload(self) -> None:
        """SIGHUP: re-render each gateway config from its source, then signal the gateways (a bad file is
        refused here as the gateway would refuse it, and the running ones keep theirs)."""
        for name, proc in self.procs.items():
            if name in self.configs and proc.returncode is None:
                try:
                    self.render(name)
                except (ValueError, OSError) as e:  # ComposeError, or a file that is not TOML
                    log(f"reload of {name} refused: {e}")
                    continue
                proc.send_signal(signal.SIGHUP)

    async def _stop_one(self, name: str) -> None:
        proc = self.procs.get(name)
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGTERM)
        grace = self.svcs[name].stop_grace_s
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except TimeoutError:
            log(f"{name} still running after {grace:g} s: killed")
            proc.kill()
            await proc.wait()

    async def stop(self) -> None:
        """Dependents first, as compose stops them (those at one level together); SIGKILL after the grace."""
        for level in reversed(levels(self.svcs, self.order)):
            await asyncio.gather(*(self._stop_one(name) for name in level))
        for t in self.pumps:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        shutil.rmtree(self.workdir, ignore_errors=True)

    def status(self) -> dict:
        out = {}
        for name in self.order:
            s, proc = self.svcs[name], self.procs.get(name)
            scheme = "redis" if s.kind == "redis" else "http"
            out[name] = {"url": f"{scheme}://{LOCAL_HOST}:{self.ports[name]}", "pid": proc.pid if proc else None,
                         "started_here": proc is not None, "config": str(self.configs[name][1])
                         if name in self.configs else None}
        return {"compose": str(self.compose), "services": out}


def levels(svcs: dict[str, Service], order: list[str]) -> list[list[str]]:
    """Services grouped by how deep they stand on others: level 0 needs none, level n needs one of level n-1."""
    depth: dict[str, int] = {}
    for name in order:  # dependencies come first in `order`
        depth[name] = 1 + max((depth[d] for d in svcs[name].depends_on), default=-1)
    return [[n for n in order if depth[n] == i] for i in range(max(depth.values(), default=-1) + 1)]


async def pump(name: str, proc: asyncio.subprocess.Process) -> None:
    """The process's output, each line prefixed with its service as `docker compose up` shows it."""
    assert proc.stdout is not None
    out = sys.stdout.buffer
    async for line in proc.stdout:
        out.write(f"{name:<10}| ".encode() + line)
        out.flush()
    log(f"{name} exited with status {await proc.wait()}")


def log(message: str) -> None:
    print(f"run_local: {message}", file=sys.stderr, flush=True)


async def redis_answers(port: int) -> bool:
    try:
        r, w = await asyncio.wait_for(asyncio.open_connection(LOCAL_HOST, port), 1.0)
    except (OSError, TimeoutError):
        return False
    try:
        w.write(b"PING\r\n")
        return (await asyncio.wait_for(r.readline(), 1.0)).startswith(b"+PONG")
    except (OSError, TimeoutError):
        return False
    finally:
        w.close()


async def http_ok(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as s, s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def until(check, what: str, proc: asyncio.subprocess.Process) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not await check():
        if proc.returncode is not None:
            raise ComposeError(f"{what} exited with status {proc.returncode} before it was healthy")
        if time.monotonic() > deadline:
            raise ComposeError(f"{what} not healthy within {START_TIMEOUT_S:g} s")
        await asyncio.sleep(0.1)


def banner(stack: Stack) -> str:
    lines = [f"shapegate stack of {stack.compose.name} running as local processes:"]
    for name, st in stack.status()["services"].items():
        where = f"pid {st['pid']}" if st["started_here"] else "the machine's own, not started here"
        lines.append(f"  {name:<10} {st['url']:<24} {where}")
    lines.append("Demo API keys (demo only): " + ", ".join(f"{k} = {v}" for k, v in DEMO_KEYS.items()))
    lines.append("Ctrl-C stops everything; SIGHUP reloads the gateway configs.")
    return "\n".join(lines)


def check_ports_free(stack: Stack) -> None:
    for name, port in stack.ports.items():
        if stack.svcs[name].kind == "redis":
            continue
        with socket.socket() as s:
            try:
                s.bind((LOCAL_HOST, port))
            except OSError:
                raise ComposeError(f"{name}: port {port} is taken here (another stack or demo running?); "
                                   "--ports free runs the stack on free ports") from None


def prepare(args: argparse.Namespace) -> Stack:
    """The compose file's stack, its ports checked, nothing started: ComposeError, OSError or yaml.YAMLError if
    it cannot run."""
    stack = Stack(args.compose.resolve(), args.ports == "free", args.key_prefix)
    if not stack.free:
        try:
            check_ports_free(stack)
        except ComposeError:
            shutil.rmtree(stack.workdir, ignore_errors=True)
            raise
    return stack


async def run(args: argparse.Namespace, stack: Stack) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, stack.reload)
    code = 0
    starting = asyncio.create_task(stack.start(), name="start")
    stopping = asyncio.create_task(stop.wait(), name="stop")
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()  # stopped while starting: stop what has started
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            return code
        starting.result()
        if args.status_file is not None:
            tmp = args.status_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(stack.status(), indent=2))
            os.replace(tmp, args.status_file)
        print(banner(stack), file=sys.stderr, flush=True)
        await stopping
    except ComposeError as e:
        log(str(e))
        code = 1
    finally:
        stopping.cancel()
        await stack.stop()
    return code


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python3 -m deploy.run_local", description=__doc__)
    p.add_argument("--compose", type=Path, default=COMPOSE, help="the compose file (default: deploy/compose.yaml)")
    p.add_argument("--ports", choices=("compose", "free"), default="compose",
                   help="compose: the compose file's ports (default); free: any free ports")
    p.add_argument("--key-prefix", default=None, help="another [state] key_prefix (a Redis shared with others)")
    p.add_argument("--status-file", type=Path, default=None,
                   help="write the services' URLs and pids here (JSON) once all are healthy")
    args = p.parse_args(argv)
    # What keeps the stack from starting at all is a usage error (exit 2); a service that fails to start, 1.
    try:
        stack = prepare(args)
    except ComposeError as e:
        log(str(e))
        return 2
    except yaml.YAMLError as e:
        log(f"{args.compose}: not valid YAML: {' '.join(str(e).split())}")
        return 2
    except OSError as e:  # the compose file cannot be read
        log(f"cannot read {e.filename or args.compose}: {e.strerror or e}")
        return 2
    import uvloop

    try:
        return uvloop.run(run(args, stack))
    except ComposeError as e:
        log(str(e))
        return 1


if __name__ == "__main__":
    sys.exit(main())
