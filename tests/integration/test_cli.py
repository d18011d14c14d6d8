"""The `shapegate` command as a process: --version, `check` against live and dead engines, one-line start-up errors."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import socket

from backends.vllm import VLLMBackend
from gateway.sim.runner import SimOptions, start_sim
from benchmarks.loopback import free_port
from tests.fake_engine import FakeEngine, Knobs
from tests.procs import shapegate, write_config

OPEN = {"auth": {"enabled": False}}


async def test_version_is_the_installed_distributions():
    status, out, err = await shapegate("--version")
    assert (status, out, err) == (0, f"shapegate {importlib.metadata.version('shapegate')}\n", "")


async def test_check_reports_each_backend_and_exits_0_with_some_down(tmp_path):
    fake = await FakeEngine().start()
    loading = await FakeEngine(Knobs(health_status=503)).start()
    vllm = await start_sim(SimOptions(engine="vllm", max_model_len=6000))
    llama = await start_sim(SimOptions(engine="llamacpp", slots=2))
    dead = free_port()
    path = write_config(tmp_path, {**OPEN, "routing": {"policy": "least_loaded"}, "backends": [
        {"id": "fake", "engine": "vllm", "url": fake.url, "models": ["m"]},
        {"id": "loading", "engine": "llamacpp", "url": loading.url, "models": ["m"]},
        {"id": "sim-v", "engine": "vllm", "url": vllm.url, "models": {"pub": vllm.model, "ghost": "ghost"}},
        {"id": "sim-l", "engine": "llamacpp", "url": llama.url, "models": ["any"], "max_context": 3000},
        {"id": "down", "engine": "sglang", "url": f"http://127.0.0.1:{dead}", "models": ["m"]},
    ]})
    try:
        status, out, err = await shapegate("check", "--config", str(path), "--timeout", "5")
    finally:
        await fake.stop()
        await loading.stop()
        await vllm.close()
        await llama.close()
    assert status == 0 and "Traceback" not in err, err
    engine_window = "6000 tokens (engine)" if hasattr(VLLMBackend, "context_window") else "unknown"
    lines = out.splitlines()
    assert lines[0] == f"{path}: configuration valid (5 backends, routing policy least_loaded)"
    assert lines[1:-1] == [
        f"backend fake: engine vllm, url {fake.url}",
        "  reachable; health: ok",
        "  engine lists: unknown (not an OpenAI model list)",  # the fake answers /v1/models with no body
        "  model m: not checked; context window: unknown",
        f"backend loading: engine llamacpp, url {loading.url}",
        "  reachable; health: HTTP 503",  # answers, not ready: no body to say why
        "  engine lists: unknown (HTTP 503)",
        "  model m: not checked; context window: unknown",
        f"backend sim-v: engine vllm, url {vllm.url}",
        "  reachable; health: ok",
        f"  engine lists: {vllm.model}",
        f"  model pub (engine name {vllm.model}): listed; context window: {engine_window}",
        f"  model ghost: NOT listed; context window: {engine_window}",
        f"backend sim-l: engine llamacpp, url {llama.url}",
        "  reachable; health: ok",
        f"  engine lists: {llama.model}",
        "  slots: 2",
        "  model any: NOT listed (llama.cpp answers to any name); context window: 3000 tokens (max_context)",
        f"backend down: engine sglang, url http://127.0.0.1:{dead}",
        f"  unreachable: connect failed: [Errno 111] Connect call failed ('127.0.0.1', {dead})",
    ]
    assert lines[-1].startswith("4 of 5 backends answered, 3 healthy; the configuration is valid")


async def test_check_of_a_healthy_portfolio(tmp_path):
    engine = await FakeEngine().start()
    path = write_config(tmp_path, {**OPEN, "backends": [{"id": "a", "engine": "vllm", "url": engine.url, "models": ["m"]}]})
    try:
        status, out, _ = await shapegate("check", "--config", str(path))
    finally:
        await engine.stop()
    lines = out.splitlines()
    assert status == 0 and lines[0] == f"{path}: configuration valid (1 backend, routing policy shape)"
    assert lines[-1] == "1 backend answered, all healthy"


async def test_check_refuses_an_invalid_config_like_serve(tmp_path):
    path = write_config(tmp_path, {**OPEN, "routing": {"policy": "prefix_affinity", "params": {"cache_threshold": 3}},
                            "backends": [{"id": "a", "engine": "vllm", "url": "http://127.0.0.1:1", "models": ["m"]}]})
    expected = ("shapegate: invalid configuration:\n"
                "  routing.params.cache_threshold: Input should be less than or equal to 1\n")
    for command in ("check", "serve"):
        assert await shapegate(command, "--config", str(path)) == (2, "", expected)


async def test_a_taken_port_is_one_line_and_status_2(tmp_path):
    path = write_config(tmp_path, {**OPEN, "backends": [{"id": "a", "engine": "vllm", "url": "http://127.0.0.1:1",
                                                  "models": ["m"]}]})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for workers in ("1", "2"):
            status, _, err = await shapegate("serve", "--config", str(path), "--port", str(port),
                                             "--workers", workers)
            assert (status, err) == (2, f"shapegate: cannot listen on 127.0.0.1:{port}: Address already in use\n")


async def test_unusable_files_are_one_message_without_a_traceback(tmp_path):
    backend = {"id": "a", "engine": "vllm", "url": "http://127.0.0.1:1", "models": ["m"]}
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("[server\nport = 1\n")
    cases = {
        str(tmp_path / "missing.toml"): f"configuration file not found: {tmp_path / 'missing.toml'}",
        str(tmp_path): f"cannot read configuration file {tmp_path}: Is a directory",
        str(bad_toml): f"{bad_toml}: not valid TOML: Expected ']' at the end of a table declaration",
        str(write_config(tmp_path, {**OPEN, "routing": {"policy": "fastest"}, "backends": [backend]}, "p.toml")):
            "invalid configuration:\n  routing.policy: unknown routing policy 'fastest'; expected one of",
        str(write_config(tmp_path, {**OPEN, "server": {"port": -1}, "backends": [backend]}, "v.toml")):
            "invalid configuration:\n  server.port: Input should be greater than or equal to 0",
    }
    for path, message in cases.items():
        status, out, err = await shapegate("serve", "--config", path)
        assert status == 2 and out == "" and err.startswith(f"shapegate: {message}"), (path, err)
        assert "Traceback" not in err


async def test_an_unreadable_file_says_permission_denied(tmp_path):
    path = write_config(tmp_path, {**OPEN, "backends": [{"id": "a", "engine": "vllm", "url": "http://127.0.0.1:1",
                                                  "models": ["m"]}]})
    path.chmod(0)
    # root reads any file; without its capabilities it is refused like anyone else
    prefix = (shutil.which("setpriv") or "setpriv", "--inh-caps=-all", "--bounding-set=-all") \
        if os.geteuid() == 0 else ()
    status, out, err = await shapegate("serve", "--config", str(path), prefix=prefix)
    assert (status, out, err) == (2, "", f"shapegate: cannot read configuration file {path}: Permission denied\n")


async def test_a_start_up_setting_error_is_one_line(tmp_path):
    path = write_config(tmp_path, {**OPEN, "dashboard": {"session_secret_env": "SHAPEGATE_TEST_SECRET"},
                            "backends": [{"id": "a", "engine": "vllm", "url": "http://127.0.0.1:1", "models": ["m"]}]})
    status, out, err = await shapegate("serve", "--config", str(path), "--port", "0",
                                       env={"SHAPEGATE_TEST_SECRET": "short"})
    assert (status, out) == (2, "")
    assert err == ("shapegate: environment variable SHAPEGATE_TEST_SECRET must hold a dashboard secret of at "
                   "least 16 characters\n")
