"""`shapegate demo`: the simulated portfolio and the gateway answer the snippet it prints."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import shutil
import sys
from pathlib import Path

import openai

from benchmarks.loopback import free_port
from gateway.cli.demo import MODEL, SECOND_MODEL, run_demo


async def test_demo_serves_the_printed_snippet():
    port = free_port()
    ready, stop = asyncio.Event(), asyncio.Event()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        task = asyncio.create_task(run_demo("127.0.0.1", port, ready=ready, stop=stop))
        await asyncio.wait_for(ready.wait(), 10)
    try:
        text = out.getvalue()
        key = re.search(r"API key : (\S+)", text).group(1)
        assert f"http://127.0.0.1:{port}" in text and "curl" in text and "from openai import OpenAI" in text
        key_file = re.search(r"kept in : (\S+)", text).group(1)
        header_file = re.search(r"-H @(\S+)", text).group(1)
        assert Path(key_file).read_text() == key + "\n"
        assert Path(header_file).read_text() == f"Authorization: Bearer {key}\n"
        assert oct(os.stat(key_file).st_mode & 0o777) == "0o600" and oct(os.stat(header_file).st_mode & 0o777) == "0o600"
        # The key appears once, on its own line; no command the demo prints carries it (ps shows command lines).
        assert [line for line in text.splitlines() if key in line] == [re.search(r".*API key : .*", text).group(0)]
        if shutil.which("curl"):  # the printed curl, as printed (the key read from the header file)
            command = text.split("curl:\n", 1)[1].split("\n\n", 1)[0].replace("\\\n", " ")
            proc = await asyncio.create_subprocess_shell(command, stdout=asyncio.subprocess.PIPE)
            reply = (await asyncio.wait_for(proc.communicate(), 30))[0]
            assert b'"error"' not in reply or b"invalid_api_key" not in reply, reply
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=3) as c:
            models = sorted(m.id for m in (await c.models.list()).data)
            assert models == sorted([MODEL, SECOND_MODEL])
            for _ in range(50):  # the engines become ready within a few probe intervals
                try:
                    r = await c.chat.completions.create(model=MODEL, max_tokens=4,
                                                        messages=[{"role": "user", "content": "Hello!"}])
                    break
                except openai.InternalServerError:
                    await asyncio.sleep(0.2)
            assert r.model == MODEL and r.choices[0].message.content
            r2 = await c.chat.completions.with_raw_response.create(
                model=SECOND_MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])
            assert r2.headers["x-shapegate-backend"] == "vllm-0"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert not os.path.exists(key_file)  # gone with the demo


async def test_the_readme_ab_walkthrough_on_the_demo(tmp_path):
    """README, "A/B testing engines": `shapegate demo --ab`, traffic with x-end-user, then `shapegate ab`."""
    port = free_port()
    ready, stop = asyncio.Event(), asyncio.Event()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        task = asyncio.create_task(run_demo("127.0.0.1", port, ready=ready, stop=stop, ab=True))
        await asyncio.wait_for(ready.wait(), 10)
    try:
        text = out.getvalue()
        key = re.search(r"API key : (\S+)", text).group(1)
        url = f"http://127.0.0.1:{port}"
        assert f"shapegate ab --url {url}   (the key from SHAPEGATE_ADMIN_KEY" in text and "--admin-key" not in text
        arms = {}
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=3) as c:
            for i in range(60):
                for _ in range(50):  # the engines become ready within a few probe intervals
                    try:
                        raw = await c.chat.completions.with_raw_response.create(
                            model=MODEL, max_tokens=8, stream=True, extra_headers={"x-end-user": f"user-{i}"},
                            messages=[{"role": "user", "content": "Hi"}])
                        break
                    except openai.InternalServerError:
                        await asyncio.sleep(0.2)
                async for _ in raw.parse():
                    pass
                arms[f"user-{i}"] = raw.headers["x-shapegate-arm"]
        assert set(arms.values()) == {"vllm", "sglang"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.cli", "ab", "--url", url, env={**os.environ, "SHAPEGATE_ADMIN_KEY": key},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
        table = stdout.decode()
        assert proc.returncode == 0, stderr.decode()
        print(table)
        assert "vllm-vs-sglang" in table and "sglang" in table and "TTFT" in table
        assert key not in table
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
