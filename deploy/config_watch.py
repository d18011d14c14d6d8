"""Sends SIGHUP to the `shapegate serve` processes of a configuration file each time the file's content changes."""

# Runs beside the gateway in its pod (deploy/k8s/gateway.yaml, shareProcessNamespace: true). Kubernetes
# updates a mounted ConfigMap by swapping a symlink some time after the object changed, and tells no
# process; the gateway re-reads its file on SIGHUP (and keeps its running configuration when the new one
# is invalid, logging why). Standard library only: it runs from the gateway's image without importing it.
from __future__ import annotations

import argparse
import hashlib
import logging
import os
import signal
import sys
import time
from pathlib import Path

log = logging.getLogger("shapegate.config-watch")


def content_digest(path: Path) -> str | None:
    """The file's SHA-256, None while it cannot be read (mid-swap, not mounted yet)."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _argv(pid: str, proc: Path) -> list[str]:
    try:
        raw = (proc / pid / "cmdline").read_bytes()
    except OSError:
        return []  # gone, or not ours to read
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _config_arg(argv: list[str]) -> str | None:
    """The --config value of a `shapegate serve` command line; None for any other command."""
    for i, arg in enumerate(argv[1:], 1):
        # `shapegate serve` (the console script) or `python -m gateway.cli serve`.
        if arg == "serve" and (os.path.basename(argv[i - 1]) == "shapegate" or argv[i - 1] == "gateway.cli"):
            rest = argv[i + 1:]
            for j, opt in enumerate(rest):
                if opt == "--config" and j + 1 < len(rest):
                    return rest[j + 1]
                if opt.startswith("--config="):
                    return opt.split("=", 1)[1]
            return None
    return None


def _parent(pid: str, proc: Path) -> str | None:
    try:
        stat = (proc / pid / "stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[1]  # the command name may hold spaces; fields after it do not


def gateway_pids(config: Path, proc: Path = Path("/proc")) -> list[int]:
    """Pids of the `shapegate serve` processes started with this configuration file, workers left out: their
    parent forwards the signal to them. Processes of any other file are never matched."""
    want = os.path.normpath(os.path.abspath(config))
    found = set()
    for entry in proc.iterdir():
        pid = entry.name
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        arg = _config_arg(_argv(pid, proc))
        if arg is None:
            continue
        if not os.path.isabs(arg):
            try:
                arg = os.path.join(os.readlink(proc / pid / "cwd"), arg)
            except OSError:
                continue
        if os.path.normpath(arg) == want:
            found.add(pid)
    return sorted(int(p) for p in found if _parent(p, proc) not in found)


def catches_sighup(pid: int, proc: Path = Path("/proc")) -> bool:
    """Whether the process has its SIGHUP handler yet: before it does, SIGHUP would end it."""
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signal.SIGHUP - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def signal_gateways(config: Path) -> list[int] | None:
    """SIGHUP to each gateway of `config`: the pids that got it, or None (nothing sent) while one of them is
    still starting and does not catch SIGHUP yet."""
    pids = gateway_pids(config)
    if not all(catches_sighup(pid) for pid in pids):
        return None
    sent = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGHUP)
        except (ProcessLookupError, PermissionError) as e:
            log.warning("cannot signal pid %d: %s", pid, e)
            continue
        sent.append(pid)
    return sent


def watch(config: Path, interval_s: float) -> None:
    """Poll the file's content; on a change, SIGHUP its gateways. Runs until the process is stopped."""
    last = content_digest(config)
    pending = False  # a change not yet signalled: a gateway was still starting
    log.info("watching %s every %g s", config, interval_s)
    while True:
        time.sleep(interval_s)
        now = content_digest(config)
        if now is not None and now != last:
            last, pending = now, True
        if not pending:
            continue
        sent = signal_gateways(config)
        if sent is None:
            continue  # try again next round
        pending = False
        if sent:
            log.info("%s changed: SIGHUP sent to %s", config, ", ".join(map(str, sent)))
        else:
            log.warning("%s changed but no `shapegate serve --config %s` is running", config, config)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="shapegate-config-watch", description=__doc__)
    p.add_argument("--config", required=True, type=Path, help="the file the gateway was started with")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between two reads of the file")
    args = p.parse_args(argv)
    if not args.interval > 0:
        p.error("--interval must be more than 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the pod stops: nothing to finish
    watch(args.config, args.interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
