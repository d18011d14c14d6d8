"""`shapegate probe` and GET /admin/probe against simulators, dead, slow and hostile engines; docs/apis.md's matrix
against the simulator; `[probe] at_start` keeping a model off a backend."""

from __future__ import annotations

import asyncio
import contextlib
import time
from http.cookies import SimpleCookie

import aiohttp
import orjson
import pytest
from aiohttp import web

from benchmarks.loopback import free_port
from gateway.config_experiments import PROBE_APIS, PROBE_FEATURES
from gateway.dashboard import COOKIE_NAME
from gateway.config_experiments import PROBE_CHECKS as CHECKS
from gateway.ops import admin_probe
from gateway.sim.runner import SimOptions, start_sim
from tests.gateway_harness import ADMIN_KEY, USER_KEY, gateway_config, start_gateway
from tests.kit import until
from tests.procs import shapegate, write_config
from tests.raw_engine import MiB, RawEngine, bad_chunk, head
from tests.support_matrix import documented

OPEN = {"auth": {"enabled": False}}
# What the simulator does with each chat feature (its real behaviour: it serves n=1 only, forces tool calls and
# schemas, gives no logprobs); its tiny profiles hold 4,096 tokens, llama.cpp's 2,048 per slot. Its APIs are
# docs/apis.md's matrix, checked by test_the_documented_matrix_is_what_the_probe_finds_on_each_simulator.
SIM_FEATURES = {"answers": "yes", "chat": "yes", "completions": "yes", "stream": "yes", "stream_usage": "yes",
                "n": "no", "tools": "yes", "json_schema": "yes", "logprobs": "no", "context": "yes"}
SIM_WINDOWS = {"vllm": 4096, "sglang": 4096, "llamacpp": 2048}
# The checks that ask the engine something (conversations is the gateway's own).
ASKED = [c for c in CHECKS if c != "conversations"]


def verdicts(row: dict) -> dict[str, str]:
    return {name: cell["verdict"] for name, cell in row["checks"].items()}


@pytest.fixture
async def sims():
    started = {e: await start_sim(SimOptions(engine=e)) for e in ("vllm", "sglang", "llamacpp")}
    yield started
    for s in started.values():
        await s.close()


def sim_backends(sims) -> list[dict]:
    # llama.cpp serves any name (with its own alias): it is listed under one the engine never heard of.
    return [{"id": "sim-v", "engine": "vllm", "url": sims["vllm"].url, "models": {"m": "sim-model", "ghost": "ghost"}},
            {"id": "sim-s", "engine": "sglang", "url": sims["sglang"].url, "models": {"m": "sim-model"}},
            {"id": "sim-l", "engine": "llamacpp", "url": sims["llamacpp"].url, "models": {"m": "any-name"}}]


async def test_json_matrix_of_a_simulator_portfolio(sims, tmp_path):
    path = write_config(tmp_path, {**OPEN, "backends": sim_backends(sims)})
    status, out, err = await shapegate("probe", "--config", str(path), "--json", "--timeout", "10")
    assert status == 1 and "Traceback" not in err, err  # "ghost" fails the required chat check
    report = orjson.loads(out)
    assert report["checks"] == list(CHECKS) and report["require"] == ["chat"] and report["passed"] is False
    assert report["timeout_s"] == 10
    rows = report["rows"]
    # Rows by model, then in the file's order.
    assert [(r["model"], r["native"], r["backend"], r["engine"]) for r in rows] == [
        ("m", "sim-model", "sim-v", "vllm"), ("m", "sim-model", "sim-s", "sglang"),
        ("m", "any-name", "sim-l", "llamacpp"), ("ghost", "ghost", "sim-v", "vllm")]
    for row in rows[:3]:
        got = verdicts(row)
        assert {c: got[c] for c in SIM_FEATURES} == SIM_FEATURES, row
        assert got["conversations"] == "gateway"
        checks = row["checks"]
        assert set(checks["chat"]) == {"verdict", "reason"} and checks["chat"]["reason"] == ""
        assert checks["n"] == {"verdict": "no", "reason": "HTTP 400: the simulator serves n=1 only", "status": 400}
        assert checks["logprobs"]["reason"] == "no logprobs content in the reply"
        assert checks["context"]["window"] == SIM_WINDOWS[row["engine"]]
        assert "refused as too long" in checks["context"]["reason"]
    vllm, sglang, llama = (r["checks"] for r in rows[:3])
    assert vllm["score"] == {"verdict": "no", "reason": "HTTP 404: Not Found", "status": 404}
    assert vllm["response_store"] == {"verdict": "no", "status": 404,
                                      "reason": "GET: HTTP 404: Response with id '{id}' not found."}
    assert sglang["messages"]["reason"] == "HTTP 404: Not Found"
    assert sglang["response_store"] == {"verdict": "partial", "status": 405,
                                        "reason": "GET served; DELETE: HTTP 405: Method Not Allowed"}
    assert llama["rerank"] == {"verdict": "no", "status": 501, "reason": "HTTP 501: This server does not support "
                                                                          "reranking. Start it with `--reranking`"}
    ghost = rows[3]["checks"]
    assert ghost.pop("answers") == {"verdict": "yes", "reason": ""}  # the engine answers; it lacks the model
    assert ghost.pop("conversations")["verdict"] == "gateway"
    assert {c["verdict"] for c in ghost.values()} == {"no"}
    assert ghost["chat"]["reason"] == "HTTP 404: The model `ghost` does not exist."


async def test_table_and_exit_status_follow_the_required_checks(sims, tmp_path):
    backends = sim_backends(sims)
    backends[0]["models"] = {"m": "sim-model"}
    cfg = {**OPEN, "probe": {"require": ["chat", "stream", "stream_usage", "context"]}, "backends": backends}
    status, out, err = await shapegate("probe", "--config", str(write_config(tmp_path, cfg)))
    assert status == 0, out + err
    lines = out.splitlines()
    apis, features = lines.index("APIs:"), lines.index("chat features:")
    assert lines[apis + 1].split() == ["model", "backend", "engine", "answers", *PROBE_APIS]
    assert lines[apis + 2].split() == ["m", "(sim-model)", "sim-v", "vllm", "yes", "yes", "yes", "no", "(404)",
                                       "yes", "no", "(404)", "yes", *["no", "(404)"] * 4, "gateway"]
    assert lines[features + 1].split() == ["model", "backend", "engine", *PROBE_FEATURES]
    assert lines[features + 2].split()[4:] == ["yes", "yes", "no", "(400)", "yes", "yes", "no", "4096"]
    assert lines[features + 4].split()[-1] == "2048"
    assert "  m @ sim-v: n: no (HTTP 400: the simulator serves n=1 only)" in lines
    assert "  m @ sim-v: embeddings, rerank, score, transcriptions, translations: no (HTTP 404: Not Found)" in lines
    assert lines[-1] == "required (chat, stream, stream_usage, context): passed on all 3 model-backend pairs"

    cfg["probe"] = {"require": ["chat", "n"]}
    status, out, _ = await shapegate("probe", "--config", str(write_config(tmp_path, cfg)))
    assert status == 1 and out.splitlines()[-1] == "required (chat, n): failed on 3 of 3 model-backend pairs"


async def test_config_errors_exit_2(tmp_path):
    backend = {"id": "a", "engine": "vllm", "url": "http://127.0.0.1:1", "models": ["m"]}
    path = write_config(tmp_path, {**OPEN, "probe": {"require": ["chat", "telepathy"]}, "backends": [backend]})
    assert await shapegate("probe", "--config", str(path)) == (
        2, "", "shapegate: invalid configuration:\n  probe.require: unknown check 'telepathy'; expected some of "
               f"{', '.join(CHECKS)}\n")
    path = write_config(tmp_path, {**OPEN, "probe": {"timeout_s": 0}, "backends": [backend]})
    status, out, err = await shapegate("probe", "--config", str(path))
    assert (status, out) == (2, "") and "probe.timeout_s" in err
    status, _, err = await shapegate("probe", "--config", str(tmp_path / "missing.toml"))
    assert status == 2 and "configuration file not found" in err


async def test_a_dead_backend_is_errors_and_exit_1_at_once(tmp_path):
    dead = free_port()
    path = write_config(tmp_path, {**OPEN, "backends": [
        {"id": "down", "engine": "sglang", "url": f"http://127.0.0.1:{dead}", "models": ["m"]}]})
    started = time.monotonic()
    status, out, err = await shapegate("probe", "--config", str(path), "--json")
    assert status == 1 and time.monotonic() - started < 10, err
    (row,) = orjson.loads(out)["rows"]
    assert {verdicts(row)[c] for c in ASKED} == {"error"}
    assert row["checks"]["answers"]["reason"].startswith("connect failed: ")
    assert row["checks"]["context"]["reason"] == "not tried: the engine did not answer"


# -- hostile engines --------------------------------------------------------------------------------------
async def flood(w: asyncio.StreamWriter, stream: bool, engine: RawEngine) -> None:
    """A 200 announcing 1 GiB, sent in 64 KiB pieces until the probe lets go (64 MiB at most)."""
    w.write(head(stream, b"Content-Length: %d" % (1 << 30)))
    for _ in range(1024):
        w.write(b"x" * (64 << 10))
        await w.drain()  # raises once the probe has closed its end


async def hang(w: asyncio.StreamWriter, stream: bool, engine: RawEngine) -> None:
    await asyncio.sleep(3600)


def not_json(stream: bool) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 9\r\n\r\nnot json!"


SECRET = "sk-probe-secret-0123456789"


def rude(stream: bool) -> bytes:
    """A refusal whose message carries terminal escapes and quotes the key it was sent."""
    body = orjson.dumps({"error": {"message": f"\x1b[31mno\x07 entry for key {SECRET}\r\nX-Injected: 1"}})
    return b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body), body)


async def test_hostile_engines_give_errors_within_the_timeout(tmp_path):
    replies = {"garbage": bad_chunk(b"zz"), "flood": flood, "hang": hang, "not-json": not_json, "rude": rude}
    engines = {}
    for name, reply in replies.items():
        engines[name] = await RawEngine().start()
        engines[name].set(reply)
    backends = [{"id": name, "engine": "openai", "url": e.url, "models": ["m"]} for name, e in engines.items()]
    backends[-1]["api_key_env"] = "PROBE_TEST_KEY"
    path = write_config(tmp_path, {**OPEN, "backends": backends})
    try:
        started = time.monotonic()
        status, out, err = await shapegate("probe", "--config", str(path), "--json", "--timeout", "1",
                                           env={"PROBE_TEST_KEY": SECRET})
        took = time.monotonic() - started
        _, table, _ = await shapegate("probe", "--config", str(path), "--timeout", "1",
                                      env={"PROBE_TEST_KEY": SECRET})
    finally:
        for e in engines.values():
            await e.stop()
    assert status == 1 and "Traceback" not in err, err
    # The hung engine holds two checks (the concurrency) for the timeout, the rest are not tried; Python's
    # start-up is the rest.
    assert took < 8, took
    rows = {r["backend"]: r["checks"] for r in orjson.loads(out)["rows"]}
    tried = [c for c in ASKED if c not in ("answers", "context")]  # context first reads a window: none here
    for name, checks in rows.items():
        assert checks["answers"]["verdict"] == "yes"  # every GET gets an empty 200
        assert checks["context"]["verdict"] in ("unknown", "error"), (name, checks["context"])
        assert checks["conversations"]["verdict"] == "gateway"
    garbage = rows["garbage"]
    assert {garbage[c]["verdict"] for c in tried} == {"error"}
    assert garbage["chat"]["reason"].startswith("malformed reply from the engine")
    assert {rows["flood"][c]["verdict"] for c in tried} == {"error"}
    assert rows["flood"]["chat"]["reason"] == f"the reply is larger than {MiB} bytes"
    assert rows["flood"]["stream"]["reason"] == f"a stream of more than {MiB} bytes"
    hung = rows["hang"]
    assert hung["chat"] == hung["completions"] == {"verdict": "error", "reason": "no whole reply within 1 s"}
    assert {hung[c]["reason"] for c in tried[2:]} <= {"not tried: the engine timed out on chat",
                                                     "not tried: the engine timed out on completions"}
    assert rows["not-json"]["chat"] == {"verdict": "error", "reason": "the reply is not JSON"}
    assert rows["not-json"]["stream"]["verdict"] == "no"  # a JSON reply to a streamed request
    assert rows["rude"]["chat"] == {"verdict": "no", "status": 400,
                                    "reason": "HTTP 400: ?[31mno? entry for key <key> X-Injected: 1"}
    assert rows["rude"]["response_store"]["reason"] == (
        "POST /v1/responses: HTTP 400: ?[31mno? entry for key <key> X-Injected: 1")
    assert SECRET not in out + table and "\x1b" not in table and "\x07" not in table
    assert "  m @ rude: chat, completions, embeddings, responses, messages, rerank, score, transcriptions, " \
           "translations, stream, stream_usage, n, tools, json_schema, logprobs: no (HTTP 400: ?[31mno? entry for " \
           "key <key> X-Injected: 1)" in table.splitlines()


# -- [probe] at_start --------------------------------------------------------------------------------------
async def served_by(url: str, model: str, times: int) -> list[tuple[int, str]]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {USER_KEY}"}) as http:
        out = []
        for _ in range(times):
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            async with http.post(url + "/v1/chat/completions", json=body) as r:
                await r.read()
                out.append((r.status, r.headers.get("x-shapegate-backend", "")))
        return out


@pytest.mark.parametrize("at_start", [True, False])
async def test_at_start_stops_routing_a_model_where_it_fails_a_required_check(sims, at_start):
    cfg = gateway_config([
        {"id": "vllm", "engine": "vllm", "url": sims["vllm"].url, "models": {"m": "sim-model", "ghost": "ghost"}},
        {"id": "llama", "engine": "llamacpp", "url": sims["llamacpp"].url, "models": {"ghost": "any-name"}},
    ], routing={"policy": "round_robin"}, probe={"at_start": at_start, "require": ["chat", "stream"]})
    gw = await start_gateway(cfg)
    try:
        pool = gw.state.pool
        vllm, llama = pool.get("vllm"), pool.get("llama")
        await until(lambda: vllm.usable(time.monotonic()) and llama.usable(time.monotonic()), timeout=10)
        if not at_start:  # off by default: nothing is probed, every backend of a model is a candidate
            await asyncio.sleep(0.3)
            assert vllm.unsupported == {} and vllm.probe_task is None
            assert {b.id for b in pool.candidates("ghost", "default")} == {"vllm", "llama"}
            return
        await until(lambda: "ghost" in vllm.unsupported, timeout=10)
        await until(lambda: vllm.probe_task.done() and llama.probe_task.done(), timeout=10)
        assert vllm.unsupported == {"ghost": "probe: chat: no (HTTP 404: The model `ghost` does not exist.)"}
        assert llama.unsupported == {}  # llama.cpp serves any name
        assert [b.id for b in pool.candidates("ghost", "default")] == ["llama"]
        assert await served_by(gw.url, "ghost", 4) == [(200, "llama")] * 4
        assert {backend for _, backend in await served_by(gw.url, "m", 2)} == {"vllm"}
        async with aiohttp.ClientSession() as http:  # the reason is in /stats for the operator
            async with http.get(gw.url + "/stats", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
                rows = {b["id"]: b for b in (await r.json())["backends"]}
        assert rows["vllm"]["unsupported"] == vllm.unsupported and rows["llama"]["unsupported"] == {}
    finally:
        await gw.stop()


# -- docs/apis.md ------------------------------------------------------------------------------------------
async def test_the_documented_matrix_is_what_the_probe_finds_on_each_simulator(tmp_path):
    rows = [r for r in documented().values() if r.sim_options() is not None]
    assert {r.target for r in rows} >= {"vllm-sim", "sglang-sim", "llamacpp-sim"}
    sims = [await start_sim(r.sim_options()) for r in rows]
    try:
        backends = [{"id": r.target, "engine": s.state.engine_name, "url": s.url, "models": ["sim-model"]}
                    for r, s in zip(rows, sims)]
        path = write_config(tmp_path, {**OPEN, "backends": backends})
        status, out, err = await shapegate("probe", "--config", str(path), "--json", "--timeout", "10")
    finally:
        for s in sims:
            await s.close()
    assert status == 0, err
    probed = {r["backend"]: {api: cell_short(r["checks"][api]) for api in PROBE_APIS}
              for r in orjson.loads(out)["rows"]}
    for r in rows:
        assert probed[r.target] == r.cells, f"docs/apis.md's row {r.target} differs from the probe's"


def cell_short(cell: dict) -> str:
    """A cell of the JSON report written as the matrix writes it (Cell.short)."""
    return f"{cell['verdict']} ({cell['status']})" if "status" in cell else cell["verdict"]


# -- GET /admin/probe ----------------------------------------------------------------------------------------
async def get_probe(url: str, headers: dict[str, str]) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.get(url + "/admin/probe", headers=headers) as r:
        return r.status, orjson.loads(await r.read())


async def test_admin_probe_reports_as_the_cli_does_and_is_no_client_traffic(sims, tmp_path):
    backends = sim_backends(sims)
    gw = await start_gateway(gateway_config(backends, probe={"require": ["chat", "embeddings"]}))
    try:
        assert (await get_probe(gw.url, {}))[0] == 401
        assert (await get_probe(gw.url, {"Authorization": f"Bearer {USER_KEY}"}))[0] == 403
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        # Two at once share one run: the engine sees as many requests as one more run alone brings.
        served = sims["vllm"].state.tel
        before = served.requests_total
        (s1, report), (s2, again) = await asyncio.gather(get_probe(gw.url, admin), get_probe(gw.url, admin))
        pair = served.requests_total - before
        await get_probe(gw.url, admin)
        assert pair == served.requests_total - before - pair > 0
        async with aiohttp.ClientSession(headers=admin) as http:
            async with http.get(gw.url + "/stats") as r:
                stats = await r.json()
            async with http.get(gw.url + "/metrics") as r:
                metrics = await r.text()
        pool = gw.state.pool
        unserved = {b.id: dict(b.unserved) for b in pool.all()}
        # The dashboard's sign-in cookie opens it too, as it opens /stats.
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
            async with http.post(gw.url + "/dashboard/login", data={"key": ADMIN_KEY}, allow_redirects=False) as r:
                token = SimpleCookie(r.headers.getall("Set-Cookie")[0])[COOKIE_NAME].value
        signed_in_status, _ = await get_probe(gw.url, {"Cookie": f"{COOKIE_NAME}={token}"})
    finally:
        await gw.stop()
    assert (s1, s2, signed_in_status) == (200, 200, 200) and report == again
    path = write_config(tmp_path, {**OPEN, "probe": {"require": ["chat", "embeddings"]}, "backends": backends})
    _, out, _ = await shapegate("probe", "--config", str(path), "--json")
    cli = orjson.loads(out)
    assert report.pop("budget_s") == 50.0
    assert report["checks"] == cli["checks"] and report["require"] == cli["require"] == ["chat", "embeddings"]
    assert report["passed"] is False  # no simulator serves embeddings by default
    assert [{k: v for k, v in r.items() if k != "checks"} for r in report["rows"]] == [
        {k: v for k, v in r.items() if k != "checks"} for r in cli["rows"]]
    for mine, theirs in zip(report["rows"], cli["rows"]):
        assert {c: v["verdict"] for c, v in mine["checks"].items()} == {
            c: v["verdict"] for c, v in theirs["checks"].items()}
    # Nothing of it reached the request path: no request counted, no route learned as unserved.
    assert stats["totals"]["requests"] == 0 and all(b["overall"]["requests"] == 0 for b in stats["backends"])
    assert "shapegate_requests_total{" not in metrics
    assert unserved == {"sim-v": {}, "sim-s": {}, "sim-l": {}}


async def test_admin_probe_ends_within_its_budget(monkeypatch):
    hung = await RawEngine().start()
    hung.set(hang)
    monkeypatch.setattr(admin_probe, "BUDGET_S", 1.5)
    gw = await start_gateway(gateway_config([{"id": "hung", "engine": "openai", "url": hung.url, "models": ["m"]}],
                                            probe={"timeout_s": 30, "concurrency": 1}))
    try:
        started = time.monotonic()
        status, report = await get_probe(gw.url, {"Authorization": f"Bearer {ADMIN_KEY}"})
        took = time.monotonic() - started
    finally:
        await gw.stop()
        await hung.stop()
    assert status == 200 and took < 5, took
    checks = report["rows"][0]["checks"]
    assert checks["chat"] == {"verdict": "error", "reason": "no whole reply within 1.5 s"}
    assert checks["completions"]["reason"] == "not tried: the engine timed out on chat"


# -- concurrency and time ------------------------------------------------------------------------------------
async def models_list(request: web.Request) -> web.Response:  # the health route of an "openai" engine
    return web.json_response({"data": []})


@contextlib.asynccontextmanager
async def engine_app(handler):
    """An "openai" engine on loopback whose every route but its health route is `handler`; yields its URL."""
    app = web.Application()
    app.router.add_get("/v1/models", models_list)
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("concurrency", [1, 3])
async def test_checks_of_a_backend_run_at_most_concurrency_at_once(tmp_path, concurrency):
    """An engine that takes 50 ms over every request: at most `concurrency` are ever inside it at once."""
    inside, most = 0, 0

    async def slow(request: web.Request) -> web.Response:
        nonlocal inside, most
        inside += 1
        most = max(most, inside)
        await request.read()
        await asyncio.sleep(0.05)
        inside -= 1
        return web.json_response({"error": {"message": "no"}}, status=404)

    async with engine_app(slow) as url:
        path = write_config(tmp_path, {**OPEN, "probe": {"concurrency": concurrency}, "backends": [
            {"id": "slow", "engine": "openai", "url": url, "models": ["a", "b"]}]})
        status, out, err = await shapegate("probe", "--config", str(path), "--json")
    assert status == 1 and "Traceback" not in err, err
    assert most == concurrency
    rows = orjson.loads(out)["rows"]
    assert [r["checks"]["score"] for r in rows] == [{"verdict": "no", "reason": "HTTP 404: no", "status": 404}] * 2


async def test_a_check_of_several_requests_has_the_timeout_for_all_of_them(tmp_path):
    """Each request within the timeout, the stored-response check's three together not: the check times out."""
    async def slow_store(request: web.Request) -> web.Response:
        await request.read()
        if request.path.startswith("/v1/responses"):
            await asyncio.sleep(0.7)
            return web.json_response({"id": "resp_1", "object": "response", "output": []})
        return web.json_response({"error": {"message": "no"}}, status=404)

    async with engine_app(slow_store) as url:
        path = write_config(tmp_path, {**OPEN, "probe": {"concurrency": 1}, "backends": [
            {"id": "slow", "engine": "openai", "url": url, "models": ["m"]}]})
        status, out, err = await shapegate("probe", "--config", str(path), "--json", "--timeout", "1")
    assert status == 1 and "Traceback" not in err, err
    (row,) = orjson.loads(out)["rows"]
    checks = row["checks"]
    assert checks["responses"] == {"verdict": "yes", "reason": ""}  # one request of 0.7 s: within the second
    assert checks["response_store"] == {"verdict": "error", "reason": "no whole reply within 1 s"}
    assert checks["messages"]["reason"] == "not tried: the engine timed out on response_store"
