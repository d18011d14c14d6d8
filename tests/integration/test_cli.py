"""The `shapegate` command as a process: --version, `check` against live and dead engines, one-line errors of every
command (and of deploy/run_local.py), `keys new`, and the admin commands' address and key from the environment."""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import shutil
import socket
import sys
import tomllib

import pytest

from backends.vllm import VLLMBackend
from benchmarks.loopback import ROOT, free_port
from gateway.config import parse_config
from gateway.keys.principal import hash_key
from gateway.runtime import build_policy
from gateway.sim.runner import SimOptions, start_sim
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import ADMIN_KEY, gateway_config, start_gateway
from tests.procs import shapegate, write_config

OPEN = {"auth": {"enabled": False}}


async def test_version_is_the_installed_distributions():
    status, out, err = await shapegate("--version")
    assert (status, out, err) == (0, f"shapegate {importlib.metadata.version('shapegate')}\n", "")


async def test_check_reports_each_backend_and_exits_1_with_some_down_or_lacking_0_when_allowed(tmp_path):
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
        status, out, err = await shapegate("check", "--config", str(path), "--timeout", "5", "--allow-missing")
        strict = await shapegate("check", "--config", str(path), "--timeout", "5")
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
        f"    fix: GET {loading.url}/health answered HTTP 503: the engine runs but is not ready (loading its model?); "
        "serve keeps probing it and routes to it once it is",
        "  engine lists: unknown (HTTP 503)",
        "  model m: not checked; context window: unknown",
        f"backend sim-v: engine vllm, url {vllm.url}",
        "  reachable; health: ok",
        f"  engine lists: {vllm.model}",
        f"  model pub (engine name {vllm.model}): listed; context window: {engine_window}",
        f"  model ghost: NOT listed; context window: {engine_window}",
        "    fix: start the engine with --served-model-name ghost, or map it in [[backends]] models",
        f"backend sim-l: engine llamacpp, url {llama.url}",
        "  reachable; health: ok",
        f"  engine lists: {llama.model}",
        "  slots: 2",
        "  model any: NOT listed (llama.cpp answers to any name); context window: 3000 tokens (max_context)",
        "    fix: start the engine with --alias any, or map it in [[backends]] models",
        f"backend down: engine sglang, url http://127.0.0.1:{dead}",
        f"  unreachable: connect failed: [Errno 111] Connect call failed ('127.0.0.1', {dead})",
        f"    fix: tried GET http://127.0.0.1:{dead}/health; nothing accepts connections at 127.0.0.1:{dead}: start "
        "the engine, or check its --host/--port and url in [[backends]] down",
    ]
    assert lines[-1].startswith("4 of 5 backends answered, 3 healthy; the configuration is valid")
    assert lines[-1].endswith("; not listed by their engine: sim-v/ghost, sim-l/any")
    # Without --allow-missing: the same report, and exit status 1 (a backend down, models not listed).
    assert strict[0] == 1 and "Traceback" not in strict[2], strict[2]
    assert strict[1].splitlines()[:-1] == lines[:-1]
    assert strict[1].splitlines()[-1] == lines[-1] + " (exit status 1; --allow-missing accepts this)"


async def test_check_exits_1_when_every_engine_lacks_the_model_and_never_says_all_healthy(tmp_path):
    """Engines started without the configured model's name: both answer and are healthy, neither serves it."""
    engines = [await start_sim(SimOptions(engine="vllm")), await start_sim(SimOptions(engine="sglang"))]
    path = write_config(tmp_path, {**OPEN, "backends": [
        {"id": "a", "engine": "vllm", "url": engines[0].url, "models": ["qwen3-30b"]},
        {"id": "b", "engine": "sglang", "url": engines[1].url, "models": ["qwen3-30b"]},
    ]})
    try:
        status, out, err = await shapegate("check", "--config", str(path), "--timeout", "5")
        allowed = await shapegate("check", "--config", str(path), "--timeout", "5", "--allow-missing")
    finally:
        for e in engines:
            await e.close()
    assert status == 1 and "Traceback" not in err, err
    lines = out.splitlines()
    assert sum(line.startswith("  model qwen3-30b: NOT listed; context window:") for line in lines) == 2
    fix = "    fix: start the engine with --served-model-name qwen3-30b, or map it in [[backends]] models"
    assert lines.count(fix) == 2
    assert lines[-1] == ("2 backends answered, 2 healthy; not listed by their engine: a/qwen3-30b, b/qwen3-30b "
                         "(exit status 1; --allow-missing accepts this)")
    assert "all healthy" not in out
    assert allowed[0] == 0 and allowed[1].splitlines()[:-1] == lines[:-1]
    assert allowed[1].splitlines()[-1] == lines[-1].removesuffix(" (exit status 1; --allow-missing accepts this)")


async def test_check_suggests_the_engines_near_name_and_says_what_to_check_when_nothing_answers(tmp_path):
    engine = await start_sim(SimOptions(engine="vllm"))
    dead = free_port()
    path = write_config(tmp_path, {**OPEN, "backends": [
        {"id": "vllm-0", "engine": "vllm", "url": engine.url, "models": [engine.model.upper()]},
        {"id": "nowhere", "engine": "sglang", "url": "http://no-such-host.invalid:30000", "models": ["m"]},
        {"id": "down", "engine": "vllm", "url": f"http://127.0.0.1:{dead}", "models": ["m"]},
    ]})
    try:
        status, out, err = await shapegate("check", "--config", str(path), "--timeout", "5")
    finally:
        await engine.close()
    assert status == 1 and "Traceback" not in err, err
    lines = out.splitlines()
    model_line = next(i for i, line in enumerate(lines) if line.startswith(f"  model {engine.model.upper()}: NOT listed"))
    fix = lines[model_line + 1]
    assert fix == (f"    fix: the engine lists {engine.model!r}: did you mean it? Write models = "
                   f"{{ \"{engine.model.upper()}\" = \"{engine.model}\" }} in [[backends]] (no engine restart), or "
                   f"start the engine with --served-model-name {engine.model.upper()}")
    nowhere = lines[lines.index("backend nowhere: engine sglang, url http://no-such-host.invalid:30000") + 2]
    assert nowhere.startswith("    fix: tried GET http://no-such-host.invalid:30000/health; ")
    assert "does not resolve" in nowhere or "did not answer in time" in nowhere, nowhere
    down = lines[lines.index(f"backend down: engine vllm, url http://127.0.0.1:{dead}") + 2]
    assert down.startswith(f"    fix: tried GET http://127.0.0.1:{dead}/health; nothing accepts connections")


async def test_every_configuration_error_at_once_by_check_serve_and_reload(tmp_path):
    good = {**OPEN, "backends": [{"id": "vllm-0", "engine": "vllm", "url": "http://127.0.0.1:1", "models": ["m"]}]}
    bad = {**OPEN, "server": {"prot": 8080}, "routing": {"policy": "least_loded"},
           "backends": [{"id": "vllm-0", "engine": "vllm", "url": "http://127.0.0.1:1", "models": ["m"]},
                        {"id": "llama-0", "engine": "llamacpp", "url": "127.0.0.1:8081", "models": ["m"],
                         "max_contex": 4096}]}
    expected = ("shapegate: invalid configuration:\n"
                "  server.prot: unknown key (did you mean `port`?)\n"
                "  backends[llama-0].url: must start with http:// or https://\n"
                "  backends[llama-0].max_contex: unknown key (did you mean `max_context`?)\n"
                "  routing.policy: unknown routing policy 'least_loded' (did you mean `least_loaded`?); expected one "
                "of least_loaded, prefix_affinity, round_robin, shape\n")
    path = write_config(tmp_path, bad)
    for command in ("check", "serve"):
        assert await shapegate(command, "--config", str(path)) == (2, "", expected)
    # A running gateway's reload refuses the same file with the same lines.
    write_config(tmp_path, good)
    from gateway.ops.reload import Reloader
    g = await start_gateway(gateway_config(good["backends"]), wait_ready=False)
    try:
        write_config(tmp_path, bad)
        with pytest.raises(Exception) as e:
            Reloader(g.state, path).reload()
        assert "shapegate: " + str(e.value) + "\n" == expected
    finally:
        await g.stop()


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


# -- every command's refusals: one line on stderr, exit status 2 ------------------------------------------------

NO_YAML = ("import runpy, sys; sys.modules['yaml'] = None; sys.argv[0] = 'run_local'; "
           "runpy.run_module('deploy.run_local', run_name='__main__')")
DEAD = "http://127.0.0.1:{dead}"
# command -> (arguments after `python`, environment, the one line it prints); {taken}: a port in use, {dead}: one
# nobody listens on.
REFUSALS = {
    "serve, a usage error": (
        ("-m", "gateway.cli", "serve", "--config", "x.toml", "--nope"), {},
        "shapegate: unrecognized arguments: --nope (see `shapegate --help`)"),
    "demo, its port taken": (
        ("-m", "gateway.cli", "demo", "--port", "{taken}"), {},
        "shapegate: cannot listen on 127.0.0.1:{taken}: Address already in use (--port picks another)"),
    "demo, no such port": (
        ("-m", "gateway.cli", "demo", "--port", "70000"), {},
        "shapegate demo: argument --port: must be a port number, 0 to 65535 (0: any free one) "
        "(see `shapegate demo --help`)"),
    "sim, its port taken": (
        ("-m", "gateway.cli", "sim", "--engine", "llamacpp", "--port", "{taken}"), {},
        "shapegate sim: cannot listen on 127.0.0.1:{taken}: Address already in use"),
    "sim, no engine": (
        ("-m", "gateway.cli", "sim"), {},
        "shapegate sim: the following arguments are required: --engine (see `shapegate sim --help`)"),
    "run_local, without PyYAML": (
        ("-c", NO_YAML), {},
        "run_local: PyYAML is needed to read deploy/compose.yaml: pip install -e '.[deploy]'"),
    "run_local, no compose file": (
        ("-m", "deploy.run_local", "--compose", "/nonexistent/compose.yaml"), {},
        "run_local: cannot read /nonexistent/compose.yaml: No such file or directory"),
    "keys, no admin key": (
        ("-m", "gateway.cli", "keys", "list"), {},
        "shapegate: no admin key: set SHAPEGATE_ADMIN_KEY (or pass --admin-key)"),
    "keys, no gateway at SHAPEGATE_URL": (
        ("-m", "gateway.cli", "keys", "revoke", "team-b"), {"SHAPEGATE_URL": DEAD, "SHAPEGATE_ADMIN_KEY": "k"},
        f"shapegate: cannot connect to {DEAD}: Connection refused"),
    "keys hash, no key": (
        ("-m", "gateway.cli", "keys", "hash"), {},
        "shapegate: empty key"),
    "ab, no admin key": (
        ("-m", "gateway.cli", "ab"), {},
        "shapegate: an admin key is needed: --admin-key KEY or the SHAPEGATE_ADMIN_KEY environment variable"),
    "ab, no gateway at SHAPEGATE_URL": (
        ("-m", "gateway.cli", "ab", "--admin-key", "k"), {"SHAPEGATE_URL": DEAD},
        f"shapegate: cannot connect to {DEAD}: Connection refused"),
    "probe, no configuration": (
        ("-m", "gateway.cli", "probe", "--config", "/nonexistent/gw.toml"), {},
        "shapegate: configuration file not found: /nonexistent/gw.toml"),
}


@pytest.fixture(scope="module")
def taken_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


@pytest.mark.parametrize("case", list(REFUSALS))
async def test_every_command_refuses_in_one_line_with_status_2(case, taken_port):
    argv, env, line = REFUSALS[case]
    ports = {"taken": taken_port, "dead": free_port()}
    env = {k: v.format(**ports) for k, v in env.items()}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *(a.format(**ports) for a in argv), cwd=ROOT, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**{k: v for k, v in os.environ.items() if k not in ("SHAPEGATE_URL", "SHAPEGATE_ADMIN_KEY")},
             "PYTHONPATH": str(ROOT), **env})
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert (proc.returncode, out.decode(), err.decode()) == (2, "", line.format(**ports) + "\n")


# -- keys new, and the admin commands' address and key from the environment -------------------------------------


async def test_keys_new_prints_a_paste_ready_block_and_the_key_apart(tmp_path):
    status, out, err = await shapegate("keys", "new", "--id", "team-a")
    assert status == 0
    key = err.splitlines()[0].removeprefix("key: ")
    assert err.splitlines()[1].startswith("Give the key to its client")
    assert key not in out and key.startswith("sg-")
    assert out.splitlines()[0] == "[[auth.keys]]" and out.splitlines()[-1].startswith("# limits = {")
    assert tomllib.loads(out) == {"auth": {"keys": [{"id": "team-a", "sha256": hash_key(key), "admin": False}]}}
    # Pasted as it is (limits uncommented too), the configuration takes it.
    block = out.replace("# limits", "limits", 1).split("   #")[0] + "\n"
    config = write_config(tmp_path, {"backends": [{"id": "a", "engine": "vllm", "url": "http://127.0.0.1:1",
                                                   "models": ["m"]}]}).read_text() + block
    cfg = parse_config(tomllib.loads(config), build_policy)
    assert [(k.id, k.sha256, k.admin, k.limits.rpm) for k in cfg.auth.keys] == [("team-a", hash_key(key), False, 600)]
    status, out, _ = await shapegate("keys", "new", "--admin")
    assert status == 0 and tomllib.loads(out)["auth"]["keys"][0]["admin"] is True


async def test_admin_commands_take_the_gateway_and_key_from_the_environment():
    engine = await FakeEngine().start()
    gw = await start_gateway(gateway_config([{"id": "a", "engine": "vllm", "url": engine.url, "models": ["m"]}]))
    env = {"SHAPEGATE_URL": gw.url, "SHAPEGATE_ADMIN_KEY": ADMIN_KEY}
    try:
        status, out, err = await shapegate("keys", "list", env=env)
        assert (status, err.splitlines()[-1]) == (0, "run-time keys kept in: memory"), err
        assert out.splitlines()[0].split()[:2] == ["id", "source"]
        assert await shapegate("ab", env=env) == (0, f"no experiments on {gw.url}\n", "")
        # --url and --admin-key win over the environment; `ab --key`, the old spelling, is still taken.
        dead = {"SHAPEGATE_URL": f"http://127.0.0.1:{free_port()}", "SHAPEGATE_ADMIN_KEY": "wrong"}
        assert await shapegate("ab", "--url", gw.url, "--admin-key", ADMIN_KEY, env=dead) == (
            0, f"no experiments on {gw.url}\n", "")
        assert (await shapegate("ab", "--url", gw.url, "--key", ADMIN_KEY, env=dead))[0] == 0
        assert (await shapegate("keys", "list", "--url", gw.url, "--admin-key", ADMIN_KEY, env=dead))[0] == 0
    finally:
        await gw.stop()
        await engine.stop()
    # One flag name in the help of every admin command; the old one hidden.
    for command in (("ab",), ("keys", "list"), ("keys", "create"), ("keys", "revoke")):
        _, text, _ = await shapegate(*command, "--help")
        assert "--admin-key" in text and "--key " not in text and "SHAPEGATE_URL" in text, command
