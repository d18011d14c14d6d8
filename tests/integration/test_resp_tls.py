"""The limiter's own Redis client over TLS: it trusts what a rediss:// URL's ssl_* options say, as redis-py does,
against a real redis-server with a private CA and a password."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
from pathlib import Path

import pytest

from benchmarks.loopback import free_port
from gateway.limits.resp import RespConnection


def make_certs(d: Path) -> None:
    """A private CA and a server certificate for localhost signed by it."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=shapegate-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr", "-subj", "/CN=localhost")
    (d / "ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run("x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", "srv.pem",
        "-days", "2", "-extfile", "ext")


@pytest.fixture
async def tls_redis(tmp_path):
    make_certs(tmp_path)
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        "redis-server", "--port", "0", "--tls-port", str(port), "--tls-cert-file", "srv.pem",
        "--tls-key-file", "srv.key", "--tls-ca-cert-file", "ca.pem", "--tls-auth-clients", "no",
        "--requirepass", "pw", "--save", "", "--appendonly", "no", "--bind", "127.0.0.1",
        cwd=tmp_path, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    for _ in range(100):
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            break
        except OSError:
            await asyncio.sleep(0.05)
    yield port, tmp_path / "ca.pem"
    proc.terminate()
    await proc.wait()


async def ping(url: str) -> object:
    conn = await RespConnection.open(url)
    try:
        return await asyncio.wait_for(conn.call("PING"), 5)
    finally:
        conn.close()


async def test_the_urls_ca_is_trusted(tls_redis):
    port, ca = tls_redis
    assert await ping(f"rediss://:pw@localhost:{port}/0?ssl_ca_certs={ca}") in ("PONG", b"PONG")


async def test_without_the_ca_the_server_is_refused(tls_redis):
    port, _ = tls_redis
    with pytest.raises(ssl.SSLCertVerificationError):
        await ping(f"rediss://:pw@localhost:{port}/0")


async def test_cert_reqs_none_skips_verification_as_redis_py_does(tls_redis):
    port, _ = tls_redis
    assert await ping(f"rediss://:pw@127.0.0.1:{port}/0?ssl_cert_reqs=none") in ("PONG", b"PONG")
