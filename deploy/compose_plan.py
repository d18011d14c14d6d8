"""deploy/compose.yaml read as a plan of local processes: each service's command, ports, mounts and health check."""

from __future__ import annotations

import os
import re
import socket
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gateway.config import ServerConfig

DEPLOY = Path(__file__).resolve().parent
COMPOSE = DEPLOY / "compose.yaml"
ROOT = DEPLOY.parent
# The keys whose digests deploy/config/gateway.toml and deploy/k8s/configmap.yaml hold: published, demo only.
DEMO_KEYS = {"demo-user": "sg-demo-user-key-not-secret", "demo-admin": "sg-demo-admin-key-not-secret"}
LOCAL_HOST = "127.0.0.1"
REDIS_PORT = 6379

# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR?error}, $VAR and $$, as compose reads them.
_VARIABLE = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)")
_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
_HEALTH_URL = re.compile(r"http://(?:127\.0\.0\.1|localhost):(\d+)(/[^'\"\s]*)")


class ComposeError(ValueError):
    """The compose file asks for something this local mirror cannot run, or is inconsistent."""


def interpolate(text: str, env: dict[str, str]) -> str:
    def value(m: re.Match) -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(5)
        op, arg = m.group(3), m.group(4) or ""
        current = env.get(name)
        missing = current is None or (current == "" and op is not None and op.startswith(":"))
        if op in (":-", "-"):
            return arg if missing else current or ""
        if op in (":?", "?") and missing:
            raise ComposeError(f"variable {name} is required: {arg or 'not set'}")
        return current or ""

    return _VARIABLE.sub(value, text)


def _walk(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_walk(x, env) for x in node]
    if isinstance(node, dict):
        return {k: _walk(v, env) for k, v in node.items()}
    return node


def dotenv(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of the project's .env file, which compose reads too (the environment wins)."""
    out: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            key, sep, val = line.strip().partition("=")
            if sep and not key.startswith("#"):
                out[key.strip()] = val.strip().strip("\"'")
    return out


def load_compose(path: Path = COMPOSE, env: dict[str, str] | None = None) -> dict:
    """The compose file with its YAML anchors merged and its variables interpolated."""
    env = {**dotenv(path.parent / ".env"), **(os.environ if env is None else env)}
    return _walk(yaml.safe_load(path.read_text()), env)


def seconds(text: str | None, default: float = 10.0) -> float:
    """A compose duration ("40s", "1m30s", "500ms") in seconds."""
    if not text:
        return default
    parts = _DURATION.findall(str(text))
    if not parts or "".join(n + u for n, u in parts) != str(text):
        raise ComposeError(f"not a duration: {text!r}")
    return sum(float(n) * _UNITS[u] for n, u in parts)


@dataclass
class Service:
    name: str
    kind: str  # "shapegate": built from this repository (the `shapegate` entry point); "redis"
    command: list[str]
    environment: dict[str, str]
    published: list[tuple[str, int, int]]  # (host address, host port, container port)
    mounts: list[tuple[Path, str]]  # (host path, path inside the container)
    depends_on: list[str]
    health_path: str | None  # the path the health check asks for on the service's own port
    health_port: int | None
    stop_grace_s: float

    def option(self, name: str) -> str | None:
        args = self.command
        for i, a in enumerate(args):
            if a == name and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(name + "="):
                return a.split("=", 1)[1]
        return None

    def host_path(self, inside: str) -> Path:
        """Where a path inside the container comes from on this machine, through the service's mounts."""
        for source, target in self.mounts:
            rel = os.path.relpath(inside, target)
            if rel == "." or not rel.startswith(".."):
                return (source / rel).resolve()
        raise ComposeError(f"{self.name}: {inside} is not under any of its volumes")


def _ports(name: str, spec: list) -> list[tuple[str, int, int]]:
    out = []
    for p in spec or ():
        if isinstance(p, dict):
            host, published, target = p.get("host_ip", LOCAL_HOST), p.get("published"), p["target"]
        else:
            parts = str(p).split("/")[0].split(":")
            if len(parts) == 1:
                raise ComposeError(f"{name}: port {p} has no fixed host port")
            host, published, target = (LOCAL_HOST, *parts) if len(parts) == 2 else parts
        if published is None or "-" in str(published):
            raise ComposeError(f"{name}: port {p} has no fixed host port")
        out.append((host, int(published), int(target)))
    return out


def _mounts(name: str, spec: list, base: Path) -> list[tuple[Path, str]]:
    out = []
    for v in spec or ():
        if isinstance(v, dict):
            source, target = v.get("source"), v["target"]
        else:
            source, target = str(v).split(":")[:2]
        if source and not source.startswith((".", "/", "~")):
            continue  # a named volume (Redis's data): the container's own storage, nothing here to mirror
        if not source:
            raise ComposeError(f"{name}: only bind mounts can be mirrored, not {v!r}")
        out.append(((base / os.path.expanduser(source)).resolve(), target))
    return out


def _environment(spec: Any) -> dict[str, str]:
    if isinstance(spec, list):
        return dict(str(e).split("=", 1) for e in spec if "=" in str(e))
    return {k: "" if v is None else str(v) for k, v in (spec or {}).items()}


def services(compose: dict, base: Path = DEPLOY) -> dict[str, Service]:
    out = {}
    for name, s in compose["services"].items():
        if "build" in s:
            context = (base / (s["build"]["context"] if isinstance(s["build"], dict) else s["build"])).resolve()
            if context != ROOT:
                raise ComposeError(f"{name}: built from {context}, not from this repository")
            kind = "shapegate"
        elif str(s.get("image", "")).startswith("redis"):
            kind = "redis"
        else:
            raise ComposeError(f"{name}: image {s.get('image')!r} has no local equivalent")
        command = [str(a) for a in s.get("command") or ()]
        test = " ".join(map(str, (s.get("healthcheck") or {}).get("test") or ()))
        url = _HEALTH_URL.search(test)
        deps = s.get("depends_on") or []
        out[name] = Service(name, kind, command, _environment(s.get("environment")), _ports(name, s.get("ports")),
                            _mounts(name, s.get("volumes"), base), list(deps),
                            url.group(2) if url else None, int(url.group(1)) if url else None,
                            seconds(s.get("stop_grace_period")))
    return out


def listen_port(s: Service) -> int:
    """The port the service's command listens on inside its container."""
    given = s.option("--port")
    if given is not None:
        return int(given)
    if s.kind == "redis":
        return REDIS_PORT
    if s.command[:1] == ["serve"]:
        path = s.host_path(s.option("--config") or "")
        try:
            server = tomllib.loads(path.read_text()).get("server", {})
            return int(server.get("port", ServerConfig.model_fields["port"].default))
        except (OSError, ValueError) as e:
            raise ComposeError(f"{s.name}: cannot read {path}: {e}") from None
    raise ComposeError(f"{s.name}: cannot tell which port `{' '.join(s.command)}` listens on")


def start_order(svcs: dict[str, Service]) -> list[str]:
    """Dependencies before the services that need them, as compose starts them."""
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in path:
            raise ComposeError(f"dependency cycle: {' -> '.join((*path, name))}")
        if name not in order:
            for dep in svcs[name].depends_on:
                visit(dep, (*path, name))
            order.append(name)

    for name in svcs:
        visit(name, ())
    return order


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOCAL_HOST, 0))
        return s.getsockname()[1]


def local_ports(svcs: dict[str, Service], free: bool) -> dict[str, int]:
    """Where each service listens here: its published host port (every replica needs its own), else its
    container port; with free=True, any free port (to run beside something holding the compose's ports)."""
    out = {}
    for name, s in svcs.items():
        if free:
            out[name] = free_port()
        elif s.published:
            out[name] = s.published[0][1]
        else:
            out[name] = listen_port(s)
    return out


def render_config(text: str, addresses: dict[str, tuple[int, int]], key_prefix: str | None = None) -> str:
    """A mounted gateway config with each `service:port` address turned into where that service runs here
    (what the compose network's names resolve to), and optionally another Redis key prefix. `addresses` maps
    a service to (the port it listens on in its container, its port here)."""
    for name, (inside, here) in addresses.items():
        text = re.sub(rf"(?<=://){re.escape(name)}:{inside}(?![0-9])", f"{LOCAL_HOST}:{here}", text)
    if key_prefix is not None:
        text, n = re.subn(r'(?m)^(\s*key_prefix\s*=\s*)"[^"\n]*"', lambda m: f'{m.group(1)}"{key_prefix}"', text)
        if n != 1:
            raise ComposeError("the config needs exactly one key_prefix line to replace")
    return text


def local_argv(s: Service, port: int, config: Path | None) -> list[str]:
    """The service's command as a local process: on loopback, on its local port, with its rendered config."""
    args = list(s.command)

    def put(name: str, value: str) -> None:
        for i, a in enumerate(args):
            if a == name:
                args[i + 1] = value
                return
            if a.startswith(name + "="):
                args[i] = f"{name}={value}"
                return
        args.extend((name, value))

    if s.kind == "redis":
        return [*args, "--port", str(port), "--bind", LOCAL_HOST]  # later options win in redis-server
    if config is not None:
        put("--config", str(config))
    put("--host", LOCAL_HOST)
    put("--port", str(port))
    return [sys.executable, "-m", "gateway.cli", *args]
