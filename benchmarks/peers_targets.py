"""What the peers benchmark drives: fake engines, shapegate, a Python floor, the vLLM and SGLang routers, nginx."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from benchmarks import kit
from benchmarks.kit import KEY, free_port

CACHE = Path(os.environ.get("SHAPEGATE_CACHE", Path.home() / ".cache" / "shapegate")) / "peers"
READY_S = 60.0  # the routers wait for their workers' health checks before they serve
PROBE = (b'{"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}')
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class Unavailable(Exception):
    """A peer that could not be installed or started; the message is the first line of the error."""

    def __init__(self, message: str, stage: str = "install") -> None:
        super().__init__(message)
        self.stage = stage


@dataclass
class Target:
    """One thing the client drives: its row label, base URL, root process (None: nothing of ours), version."""
    id: str
    label: str
    url: str
    proc: subprocess.Popen | None
    version: str
    command: str
    log: Path | None = None  # its stderr


def first_line(text: str) -> str:
    """The line of a failure's output that says what went wrong: a Python traceback's exception, a Rust panic's
    message, else the first line naming an error, else the last line."""
    lines = [ANSI.sub("", x).strip() for x in text.splitlines() if x.strip()]
    raised = [x for x in lines if re.match(r"[\w.]+(Error|Exception|Exit|Interrupt)\b.*:", x)]
    panic = next((i for i, x in enumerate(lines) if " panicked at " in x), None)
    if raised:
        hit = raised[-1]  # the traceback's last exception is the one that stopped the process
    elif panic is not None:
        hit = " ".join(lines[panic:panic + 2])  # the location line, then the message
    else:
        hit = next((x for x in lines if re.search(r"error|panic|exception|failed|not found|denied", x, re.IGNORECASE)),
                   lines[-1] if lines else "no output")
    return hit[:300]


def run(cmd: list[str], timeout: float = 900) -> str:
    """A setup command's output; its failure (the first line of what it said) as Unavailable."""
    try:
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Unavailable(f"{' '.join(cmd[:3])}: {e}") from None
    if done.returncode != 0:
        raise Unavailable(f"{' '.join(cmd[:4])} exited {done.returncode}: {first_line(done.stderr + done.stdout)}")
    return done.stdout + done.stderr


# -- installing ----------------------------------------------------------------------------------
def pip_peer(package: str) -> tuple[Path, str]:
    """The peer's own venv under the cache (made once, reused), its bin directory and the installed version."""
    venv = CACHE / f"{package}-venv"
    python = venv / "bin" / "python"
    ask = f"import importlib.metadata as m; print(m.version({package!r}))"
    if python.exists():
        try:
            return venv / "bin", run([str(python), "-c", ask]).strip()
        except Unavailable:
            pass  # a venv left half-made: install into it again
    CACHE.mkdir(parents=True, exist_ok=True)
    run([sys.executable, "-m", "venv", str(venv)])
    run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", package])
    return venv / "bin", run([str(python), "-c", ask]).strip()


def apt_binary(binary: str, package: str) -> str:
    """The path of a binary a Debian package provides, installing the package when the binary is missing."""
    found = shutil.which(binary) or shutil.which(binary, path="/usr/sbin:/usr/bin")
    if found:
        return found
    env_cmd = ["env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "install", "-y", "-q", package]
    try:
        run(env_cmd)
    except Unavailable:
        run(["apt-get", "update", "-q"])  # a first install on a machine whose package lists were never read
        run(env_cmd)
    found = shutil.which(binary) or shutil.which(binary, path="/usr/sbin:/usr/bin")
    if not found:
        raise Unavailable(f"{package} installed but no {binary} on PATH")
    return found


def deb_version(package: str) -> str:
    try:
        return run(["dpkg-query", "-W", "-f", "${Version}", package]).strip()
    except Unavailable:
        return "unknown"


# -- starting ------------------------------------------------------------------------------------
def ready(url: str, key: str = KEY) -> bool:
    """Whether a chat completion through `url` answers 200: the target routes, not merely listens."""
    req = urllib.request.Request(url + "/v1/chat/completions", PROBE, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _start(cmd: list[str], url: str, log: Path, cwd: Path | None, keep_stdout: bool) -> subprocess.Popen | int | None:
    """The process once it routes; else (stopped) its exit code, or None when it was still up at the deadline."""
    with log.open("wb") as err:
        proc = subprocess.Popen(cmd, stdout=err if keep_stdout else subprocess.DEVNULL, stderr=err, cwd=cwd,
                                start_new_session=True)
    deadline = time.monotonic() + READY_S
    while proc.poll() is None and time.monotonic() < deadline:
        if ready(url):
            return proc
        time.sleep(0.1)
    code = proc.poll()
    kit.stop_all([proc])
    return code


def launch(cmd: list[str], url: str, log: Path, cwd: Path | None = None) -> subprocess.Popen:
    """Start a target with its stdout (request logs) to /dev/null, as every target's; wait until it routes.
    When it does not, start it once more with stdout kept, so the failure can be named from its own words."""
    first = _start(cmd, url, log, cwd, keep_stdout=False)
    if isinstance(first, subprocess.Popen):
        return first
    kept = log.with_suffix(".stdout.log")
    second = _start(cmd, url, kept, cwd, keep_stdout=True)
    if isinstance(second, subprocess.Popen):  # up this time: measured as the others are, without a kept stdout
        kit.stop_all([second])
        third = _start(cmd, url, log, cwd, keep_stdout=False)
        if isinstance(third, subprocess.Popen):
            return third
    code = second if not isinstance(second, subprocess.Popen) else first
    reason = first_line(kept.read_text(errors="replace"))
    raise Unavailable(f"exited with code {code}: {reason}" if code is not None
                      else f"not routing after {READY_S:.0f} s: {reason}", "start")


def start_engines(n: int, tmp: Path) -> list[tuple[str, subprocess.Popen]]:
    """n zero-delay engines (benchmarks/fast_engine.py, 200-chunk streams)."""
    out = []
    for i in range(n):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = kit.script("fast_engine.py", "--port", str(port), "--chunks", "200")
        out.append((url, launch(cmd, url, tmp / f"engine-{i + 1}.log")))
    return out


def compiled_tree(tmp: Path) -> Path:
    """A copy of this tree with the request path compiled by deploy/compile.py (as the image runs it), made once."""
    tree = tmp / "compiled"
    if not tree.exists():
        from deploy.compile import compiled_copy
        try:
            compiled_copy(tree)
        except SystemExit as e:  # (mypyc's own words)
            shutil.rmtree(tree, ignore_errors=True)
            raise Unavailable(first_line(str(e.code)), "build") from None
    return tree


def start_shapegate(tmp: Path, engines: list[str], workers: int, compiled: bool = True) -> Target:
    """shapegate as the image runs it (compiled), or from its plain sources; `python -m` in the tree's directory
    imports that tree's modules."""
    from gateway.cli.main import version
    port = free_port()
    # The benchmarks' config (one key, access log on, no warm-up request), no [stats] section, two backends.
    cfg = kit.gateway_config(tmp / "shapegate.toml", engines, stats=None)
    cmd = kit.serve_argv(cfg, port)
    if workers > 1:
        cmd += ["--workers", str(workers)]
    url = f"http://127.0.0.1:{port}"
    tid = ("shapegate" if workers == 1 else f"shapegate-w{workers}") if compiled else "shapegate-source"
    log = tmp / f"{tid}.log"
    proc = launch(cmd, url, log, cwd=compiled_tree(tmp) if compiled else kit.ROOT)
    label = "shapegate" if workers == 1 else f"shapegate --workers {workers}"
    where = "in a copy compiled by deploy/compile.py" if compiled else "from the uncompiled sources"
    return Target(tid, label if compiled else "shapegate, uncompiled", url, proc, version(),
                  "python3 -m gateway.cli serve --config CFG" + (f" --workers {workers}" if workers > 1 else "")
                  + f" ({where})", log)


def start_vllm_router(tmp: Path, engines: list[str]) -> Target:
    bindir, ver = pip_peer("vllm-router")
    port = free_port()
    cmd = [str(bindir / "vllm-router"), "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
           "--prometheus-port", str(free_port()), "--worker-urls", *engines]
    url = f"http://127.0.0.1:{port}"
    log = tmp / "vllm-router.log"
    return Target("vllm-router", "vLLM router", url, launch(cmd, url, log), ver,
                  "vllm-router --policy round_robin --worker-urls E1 E2 (other flags at their defaults)", log)


def start_sglang_router(tmp: Path, engines: list[str]) -> Target:
    bindir, ver = pip_peer("sglang-router")
    port = free_port()
    cmd = [str(bindir / "python"), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--policy", "round_robin", "--prometheus-port", str(free_port()), "--worker-urls", *engines]
    url = f"http://127.0.0.1:{port}"
    log = tmp / "sglang-router.log"
    return Target("sglang-router", "SGLang router", url, launch(cmd, url, log), ver,
                  "python -m sglang_router.launch_router --policy round_robin --worker-urls E1 E2 "
                  "(other flags at their defaults)", log)


def start_parsing_proxy(tmp: Path, engines: list[str]) -> Target:
    """benchmarks/parsing_proxy.py: what a Python process spends when it reads what it routes, and no more."""
    port = free_port()
    cmd = kit.script("parsing_proxy.py", "--port", str(port), "--key", KEY)
    for u in engines:
        cmd += ["--engine", u]
    url = f"http://127.0.0.1:{port}"
    log = tmp / "parsing-proxy.log"
    return Target("python-floor", "Python floor", url, launch(cmd, url, log, cwd=kit.ROOT),
                  f"on Python {sys.version.split()[0]}",
                  "python3 benchmarks/parsing_proxy.py --engine E1 --engine E2 --key KEY", log)


NGINX_CONF = """worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    upstream engines {{
{servers}
        keepalive 128;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port};
        keepalive_requests 1000000;
        location / {{
            proxy_pass http://engines;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def start_nginx(tmp: Path, engines: list[str]) -> Target:
    binary = apt_binary("nginx", "nginx-light")
    d = tmp / "nginx"
    d.mkdir(exist_ok=True)
    port = free_port()
    servers = "\n".join(f"        server {u.removeprefix('http://')};" for u in engines)
    (d / "nginx.conf").write_text(NGINX_CONF.format(d=d, servers=servers, port=port))
    cmd = [binary, "-p", str(d), "-e", str(d / "error.log"), "-c", str(d / "nginx.conf"), "-g", "daemon off;"]
    url = f"http://127.0.0.1:{port}"
    ver = run([binary, "-v"]).strip().removeprefix("nginx version: nginx/")
    log = tmp / "nginx.log"
    return Target("nginx", "nginx", url, launch(cmd, url, log), f"{ver} (Debian nginx-light "
                  f"{deb_version('nginx-light')})", "nginx -p DIR -c nginx.conf -g 'daemon off;' "
                  "(worker_processes 1, upstream keepalive 128, proxy_buffering off, access_log off)", log)


# -- CPU -----------------------------------------------------------------------------------------
def _tree(root: int) -> dict[int, list[str]]:
    """pid -> /proc/pid/stat fields (after the command name) of `root` and every process below it."""
    stats: dict[int, list[str]] = {}
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            fields = kit.stat_fields(pid)
        except OSError:
            continue  # exited meanwhile
        stats[pid] = fields
        children.setdefault(int(fields[1]), []).append(pid)
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            out[pid] = stats[pid]
        todo += children.get(pid, [])
    return out


def tree_cpu(root: int) -> float:
    """User + system seconds of `root` and every process below it (a process's figures include its threads)."""
    ticks = sum(int(f[11]) + int(f[12]) for f in _tree(root).values())
    return ticks / os.sysconf("SC_CLK_TCK")


def tree_shape(root: int) -> dict[str, int]:
    """How many processes and threads a target runs as."""
    tree = _tree(root)
    return {"processes": len(tree), "threads": sum(int(f[17]) for f in tree.values())}
