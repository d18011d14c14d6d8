"""`shapegate serve --workers N`: N gateway processes on one port, their metrics and stats shared through files."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import traceback
from typing import Callable

from gateway.stats.share import REPLICA_ENV, STATS_DIR_ENV, WORKERS_ENV, new_replica_id

log = logging.getLogger("shapegate")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# The dashboard's cookie-signing secret of a group without [dashboard] session_secret_env: made once here, so
# that a sign-in holds on whichever worker the kernel hands a connection to (gateway/app.py reads it).
GROUP_SECRET_ENV = "SHAPEGATE_GROUP_SESSION_SECRET"


def run_workers(n: int, worker: Callable[[], int]) -> int:
    """Fork `n` processes that each run `worker()` (binding the port with SO_REUSEPORT); return when all ended.

    SIGTERM/SIGINT/SIGHUP sent to this process go to every worker. A worker that exits on its own stops
    the others, so a supervisor sees one failed service rather than a silently smaller one.
    """
    # Before the workers make any metric. prometheus_client picks its value store when it is imported; if
    # reading the configuration imported it already, it picks again here, or each worker would count alone.
    metrics_dir = tempfile.mkdtemp(prefix="shapegate-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    values = sys.modules.get("prometheus_client.values")
    if values is not None:
        values.ValueClass = values.get_value_class()
    # Beside it, each worker's /stats summary (gateway/stats/share.py): any worker's /stats merges them all.
    stats_dir = os.path.join(metrics_dir, "stats")
    os.mkdir(stats_dir, 0o700)  # the group's run-time keys file may be kept here: this user's only
    os.environ[STATS_DIR_ENV] = stats_dir
    os.environ[WORKERS_ENV] = str(n)
    os.environ[REPLICA_ENV] = new_replica_id()  # the workers are one replica to the others sharing Redis
    # Only this user (and root) can read a process's environment; the workers are forked, nothing is executed.
    os.environ[GROUP_SECRET_ENV] = secrets.token_urlsafe(32)
    children: set[int] = set()
    stopping = False

    def forward(sig: int, _frame) -> None:
        nonlocal stopping
        stopping = stopping or sig != signal.SIGHUP
        for pid in children:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass  # already gone; waitpid below collects it

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        for _ in range(n):
            pid = os.fork()
            if pid == 0:
                _child(previous, worker)
            children.add(pid)
        log.info("%d workers (pids %s), metrics aggregated in %s", n,
                 ", ".join(map(str, sorted(children))), metrics_dir)
        return _reap(children, metrics_dir, stats_dir, lambda: stopping)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.environ.pop(GROUP_SECRET_ENV, None)
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _child(previous: dict, worker: Callable[[], int]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    code = 1
    try:
        code = worker()
    except SystemExit as e:  # a clean refusal (e.g. the port is taken): its message, not a traceback
        if isinstance(e.code, int):
            code = e.code
        elif e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:  # the worker's last word goes to stderr before the process ends
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(children: set[int], metrics_dir: str, stats_dir: str, stopping: Callable[[], bool]) -> int:
    from prometheus_client import multiprocess

    code = 0
    while children:
        pid, status = os.waitpid(-1, 0)
        if pid not in children:
            continue
        children.discard(pid)
        multiprocess.mark_process_dead(pid, metrics_dir)  # its live gauges (in-flight, pool state) stop counting
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(stats_dir, f"{pid}.json"))  # nor does its last stats summary
        rc = os.waitstatus_to_exitcode(status)
        if not stopping() and not code:
            log.error("worker %d exited unexpectedly (%d); stopping the others", pid, rc)
            code = 1
            for other in children:
                try:
                    os.kill(other, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        elif rc not in (0, -signal.SIGTERM, -signal.SIGINT):
            code = 1
    return code
