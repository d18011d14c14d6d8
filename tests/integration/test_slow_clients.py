"""Slow and greedy clients against a real gateway: every wait timed, connection caps, file limits, keys kept out of logs."""

from __future__ import annotations

import asyncio
import io
import resource
import secrets
import signal
import socket
import sys
import time
from dataclasses import dataclass

import orjson
import pytest

from benchmarks.loopback import free_port, wait_http
from gateway.keys.principal import hash_key
from gateway.observe.access_log import AccessLog
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import gateway_config
from tests.procs import ROOT, to_toml
from tests.raw_http import (AFTER, AUTH, CHUNKED_HEAD, CT, HOST, KEY, assert_error, chat, cl, close, exchange, post,
                            prompts, read_response, req, rest_of_connection, rig, stop)

# ===================================================================================================
# 3. Slow clients: every wait is bounded.
# ===================================================================================================
SLOW = {"head_timeout_s": 0.3, "body_timeout_s": 0.3, "write_timeout_s": 0.3, "keepalive_s": 5.0}



@dataclass(frozen=True)
class Slow:
    sent: bytes  # at once after connecting
    drip: bytes = b""  # then one byte of this every 50 ms, until the gateway answers
    status: int | None = 408  # None: closed without a reply
    api: bool = False  # the request reaches the pipeline (it gets an access-log line)


LOGIN = b"key=" + KEY
SLOW_ROWS = {
    "head_never_ends": Slow(post("a")[:40]),
    "head_dripped_a_byte_at_a_time": Slow(b"POST /v1/chat/completions HTTP/1.1\r\n", drip=b"X-Pad: " + b"p" * 1000),
    "body_never_ends": Slow(post("a")[:-5], api=True),
    "body_dripped_a_byte_at_a_time": Slow(post("a")[:-len(chat("a"))], drip=chat("a") * 10, api=True),
    "chunked_body_never_ends": Slow(CHUNKED_HEAD + b"4\r\n{\"mo\r\n", api=True),
    "nothing_sent": Slow(b"", status=None),
    "dashboard_login_body_never_ends": Slow(req(HOST, b"Content-Type: application/x-www-form-urlencoded",
                                                cl(len(LOGIN) + 10), body=LOGIN,
                                                start=b"POST /dashboard/login HTTP/1.1")),
}


@pytest.mark.parametrize("name", list(SLOW_ROWS))
async def test_slow_client_is_answered_408_and_closed(name):
    row = SLOW_ROWS[name]
    r = await rig(SLOW)
    log = io.StringIO()
    r.gw.state.access_log = AccessLog(True, stream=log)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", r.gw.port)
        t0 = time.monotonic()
        writer.write(row.sent)

        async def drip() -> None:
            for b in row.drip:
                await asyncio.sleep(0.05)
                writer.write(bytes([b]))

        dripping = asyncio.create_task(drip())
        try:
            if row.status is None:
                assert await rest_of_connection(reader) == b""
            else:
                reply = await read_response(reader)
                assert_error(reply, row.status, "request_timeout")
                assert reply.headers.get("connection") == "close"
                assert await rest_of_connection(reader) == b""
        finally:
            dripping.cancel()
        elapsed = time.monotonic() - t0
        await close(writer)
        # Not before the timeout, and not long after it: dripping bytes does not extend the wait.
        assert 0.25 <= elapsed < 1.5, elapsed
        assert r.engine.knobs.seen == []
        r.gw.state.access_log.flush()
        lines = [orjson.loads(x) for x in log.getvalue().splitlines()]
        assert [x["status"] for x in lines] == ([408] if row.api else [])
        assert (await exchange(r.gw.port, post(AFTER))).status == 200
    finally:
        await stop(r)


async def test_a_client_that_never_reads_its_stream_is_dropped_and_the_engine_request_aborted():
    r = await rig(SLOW)
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", r.gw.port))
        body = orjson.dumps({"model": "m2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400_000,
                             "stream": True})
        await asyncio.get_running_loop().sock_sendall(sock, req(HOST, AUTH, CT, cl(len(body)), body=body))
        t0 = time.monotonic()
        # Nothing is read: the gateway's writes back up, and after write_timeout_s it gives up.
        while r.engine.knobs.aborted == 0 and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.05)
        assert r.engine.knobs.aborted == 1, "the engine's request was not aborted"
        assert r.gw.state.pool.get("e").in_flight == 0
        sock.setblocking(True)
        sock.settimeout(5)
        try:  # the connection is gone: what was sent is readable, then it ends
            while sock.recv(1 << 16):
                pass
        except ConnectionResetError:
            pass
        assert (await exchange(r.gw.port, post(AFTER))).status == 200
    finally:
        sock.close()
        await stop(r)


CAPS = {
    # 16 connections at most: each one past it makes the oldest still sending its request give way (408).
    "max_connections": ({"max_connections": 16}, 20, 4),
    # 2 connections part-way through a request at most: past it the oldest such gets 408.
    "max_reading_connections": ({"max_reading_connections": 2}, 5, 3),
}


@pytest.mark.parametrize("name", list(CAPS))
async def test_connection_caps_refuse_the_oldest_slow_client(name):
    server, n, refused = CAPS[name]
    r = await rig({"head_timeout_s": 5.0, **server})
    slow: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        for _ in range(n):
            reader, writer = await asyncio.open_connection("127.0.0.1", r.gw.port)
            writer.write(post("slow")[:30])
            slow.append((reader, writer))
            await asyncio.sleep(0.02)  # one at a time: which is oldest is certain
        for reader, _ in slow[:refused]:  # at once, not at the head timeout
            reply = await read_response(reader, timeout=1.0)
            assert_error(reply, 408, "request_timeout")
            assert await rest_of_connection(reader, 1.0) == b""
        assert (await exchange(r.gw.port, post(AFTER))).status == 200
        for reader, _ in slow[-(n - refused - 1):]:  # the newest are still waiting for the rest of their head
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(reader.read(1), 0.05)
        assert prompts(r.engine.knobs) == [AFTER]
    finally:
        for _, writer in slow:
            await close(writer)
        await stop(r)


# ===================================================================================================
# 4, 5. A gateway process: a file-descriptor limit, and what it writes to stdout and stderr.
# ===================================================================================================
class GatewayProcess:
    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc, self.port = proc, port
        self.out = asyncio.ensure_future(proc.stdout.read())
        self.err = asyncio.ensure_future(proc.stderr.read())

    async def stop(self) -> tuple[bytes, bytes]:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        return await self.out, await self.err


async def gateway_process(tmp_path, cfg: dict, nofile: int | None = None) -> GatewayProcess:
    (tmp_path / "gw.toml").write_text(to_toml(cfg))
    port = free_port()

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "serve", "--config", str(tmp_path / "gw.toml"), "--port", str(port),
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        preexec_fn=limit_files if nofile is not None else None)
    gp = GatewayProcess(proc, port)
    try:
        await wait_http(f"http://127.0.0.1:{port}/readyz", 20.0)
    except BaseException:
        await gp.stop()
        raise
    return gp


async def test_file_descriptor_exhaustion_leaves_room_for_a_normal_client(tmp_path):
    """300 connections that never finish their body, against a process allowed 256 files: the oldest make
    room (the front's cap is (256-64)//2), and a normal client still gets its answer."""
    engine = await FakeEngine(Knobs()).start()
    cfg = gateway_config([{"id": "e", "engine": "vllm", "url": engine.url, "models": ["m2"]}],
                         server={"access_log": False, "head_timeout_s": 30.0, "body_timeout_s": 30.0})
    gp = await gateway_process(tmp_path, cfg, nofile=256)
    hostile: list[asyncio.StreamWriter] = []
    try:
        body = chat("slow")
        for _ in range(300):
            _, writer = await asyncio.open_connection("127.0.0.1", gp.port)
            writer.write(req(HOST, AUTH, CT, cl(len(body)), body=body[:10]))
            hostile.append(writer)
        t0 = time.monotonic()
        try:
            reply = await exchange(gp.port, post(AFTER))
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            pytest.fail(f"the normal client's connection was closed without a reply ({type(e).__name__})")
        assert reply.status == 200 and time.monotonic() - t0 < 5
        assert prompts(engine.knobs) == [AFTER]
        assert gp.proc.returncode is None
    finally:
        for w in hostile:
            w.close()
        out, err = await gp.stop()
        await engine.stop()
    assert b"Traceback" not in err, err.decode(errors="replace")[-3000:]


async def test_keys_in_malformed_places_never_reach_the_logs(tmp_path):
    engine = await FakeEngine(Knobs()).start()
    secret = "sk-admin-" + secrets.token_hex(16)
    cfg = gateway_config([{"id": "e", "engine": "vllm", "url": engine.url, "models": ["m2"]}],
                         server={"access_log": True})
    cfg["auth"]["keys"].append({"id": "leak-check", "sha256": hash_key(secret), "admin": True})
    gp = await gateway_process(tmp_path, cfg)
    k = secret.encode()
    attempts = {
        "control_char_after_key": (post("a").replace(AUTH, b"Authorization: Bearer " + k + b"\x01"), 400),
        "bare_lf_after_key": (post("a").replace(AUTH, b"Authorization: Bearer " + k + b"\nX-A: b"), 400),
        "over_long_header_after_key": (post("a").replace(AUTH, b"Authorization: Bearer " + k
                                                         + b"\r\nX-Pad: " + b"p" * 40_000), 431),
        "key_in_invalid_request_id": (post("a", b"x-request-id: " + k + b" " + k), 200),
        "key_in_url_of_bad_request_line": (b"GET /v1/models?key=" + k + b"\x7f HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        "key_in_url_with_bare_lf": (b"GET /v1/models?key=" + k + b" HTTP/1.1\nHost: x\n\n", 400),
        "key_as_x_api_key_then_nul": (post("a").replace(AUTH, b"x-api-key: " + k + b"\x00"), 400),
        "key_with_a_typo_in_dashboard_login": (
            req(HOST, b"Content-Type: application/x-www-form-urlencoded", cl(len(b"key=" + k + b"x")),
                body=b"key=" + k + b"x", start=b"POST /dashboard/login HTTP/1.1"), 401),
    }
    replies = {}
    try:
        for name, (data, status) in attempts.items():
            reply = await exchange(gp.port, data)
            assert reply.status == status, (name, reply.status, reply.body[:300])
            replies[name] = reply
    finally:
        out, err = await gp.stop()
        await engine.stop()
    # The one request that reached the pipeline has its access-log line, under the gateway's own id: the
    # log was written, so its absence of the key below means something.
    lines = [orjson.loads(x) for x in out.splitlines()]
    assert [x["request_id"] for x in lines] == [replies["key_in_invalid_request_id"].headers["x-request-id"]]
    secret_part = k[len(b"sk-admin-"):]
    for text, where in [(out, "stdout"), (err, "stderr")]:
        assert secret_part not in text, f"the key is in the gateway's {where}"
    for name, reply in replies.items():
        raw = b"".join(f"{a}: {b}".encode("latin-1") for a, b in reply.headers.items()) + reply.body
        assert secret_part not in raw, f"the key is echoed in the reply to {name}"
    assert secret_part not in repr(engine.knobs.headers_seen).encode()

