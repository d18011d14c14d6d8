"""The gateway's queue on loopback: requests wait in the gateway while every backend's seats are taken, and leave in
priority order, fairly across keys, within their client's deadline, or not at all once their client left; bounds
refuse with Retry-After; every API waits and is served; /stats and /metrics show the queue."""

from __future__ import annotations

import asyncio

import aiohttp
import anthropic
import openai
import pytest

from gateway.keys.principal import hash_key
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import ADMIN_KEY, USER_KEY, gateway_config, start_gateway
from tests.integration.failover_kit import backend, sim
from tests.kit import until

KEYS = {"user": USER_KEY, "ops": ADMIN_KEY, "boss": "sk-test-boss", "flood": "sk-test-flood"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def config(backends: list[dict], **sections) -> dict:
    keys = [{"id": "user", "sha256": hash_key(USER_KEY)},
            {"id": "ops", "sha256": hash_key(ADMIN_KEY), "admin": True},
            {"id": "boss", "sha256": hash_key(KEYS["boss"]), "priority_header": True},
            {"id": "flood", "sha256": hash_key(KEYS["flood"])}]
    sections["queue"] = {"enabled": True, **sections.get("queue", {})}  # (the default, said where it is tested)
    return gateway_config(backends, auth={"keys": keys}, **sections)


_clients: dict[tuple[str, str], openai.AsyncOpenAI] = {}


def client(gw, key: str = "user") -> openai.AsyncOpenAI:
    """One client per gateway and key (closed with the gateway: stop())."""
    c = _clients.get((gw.url, key))
    if c is None:
        c = _clients[gw.url, key] = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEYS[key], max_retries=0)
    return c


async def stop(gw) -> None:
    for k in [k for k in _clients if k[0] == gw.url]:
        await _clients.pop(k).close()
    await gw.stop()


def ask(gw, text: str, key: str = "user", max_tokens: int = 4, headers: dict | None = None) -> asyncio.Task:
    return asyncio.create_task(client(gw, key).chat.completions.create(
        model="m", messages=[{"role": "user", "content": text}], max_tokens=max_tokens, extra_headers=headers))


def texts(engine: FakeEngine) -> list[str]:
    """The requests the engine received, in the order it received them, by their text."""
    return [body["messages"][0]["content"] for body in engine.knobs.seen]


@pytest.fixture
async def gated():
    """An engine that holds every request until the test opens its gate, behind a gateway that knows it has one
    seat (the rest wait in the gateway)."""
    e = await FakeEngine(Knobs(gate=asyncio.Event())).start()
    yield e
    e.knobs.gate.set()
    await e.stop()


async def one_seat(e: FakeEngine, **sections):
    return await start_gateway(config([backend("e", "openai", e.url, {"m": "m"}, seats=1)], **sections))


async def hold_the_seat(gw, e: FakeEngine) -> asyncio.Task:
    holder = ask(gw, "holder", key="ops")
    await until(lambda: texts(e) == ["holder"], "the holder at the engine")
    return holder


async def hold_a_stream(s: aiohttp.ClientSession, gw, model: str) -> aiohttp.ClientResponse:
    """A long stream through the gateway, once its first bytes came (it holds its seat until closed)."""
    body = {"model": model, "messages": [{"role": "user", "content": "hold"}], "max_tokens": 3000, "stream": True}
    holder = await s.post(gw.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {USER_KEY}"})
    await holder.content.readany()
    return holder


async def queued(gw, n: int) -> None:
    await until(lambda: gw.state.queue.length == n, f"{n} requests queued")


async def test_priorities_go_first_and_stats_and_metrics_show_the_queue(gated):
    gw = await one_seat(gated)
    try:
        with pytest.raises(openai.BadRequestError) as bad:  # checked even when a seat is free
            await ask(gw, "bad", key="boss", headers={"x-shapegate-priority": "urgent"})
        assert bad.value.body["param"] == "x-shapegate-priority" and texts(gated) == []
        holder = await hold_the_seat(gw, gated)
        tasks = []
        for i, p in enumerate(["low", "normal", "high", "normal"]):
            tasks.append(ask(gw, f"{p}{i}", key="boss", headers={"x-shapegate-priority": p}))
            await queued(gw, i + 1)
        tasks.append(ask(gw, "ignored", key="user", headers={"x-shapegate-priority": "high"}))  # not allowed: normal
        await queued(gw, 5)
        async with aiohttp.ClientSession() as s:
            async with s.get(gw.url + "/stats", headers=ADMIN) as r:
                q = (await r.json())["queue"]
            async with s.get(gw.url + "/metrics") as r:
                metrics = await r.text()
            async with s.get(gw.url + "/dashboard/feed", headers=ADMIN) as r:
                assert (await r.json())["queue"]["length"] == 5  # the dashboard's "queued"
        assert q["length"] == 5
        assert {p: row["length"] for p, row in q["priorities"].items()} == {"high": 1, "normal": 3, "low": 1}
        assert 'shapegate_queue_length{priority="normal"} 3.0' in metrics
        assert 'shapegate_queue_length_by_key{key="boss"} 4.0' in metrics
        assert 'shapegate_queue_length_by_key{key="user"} 1.0' in metrics
        assert texts(gated) == ["holder"], "nothing went to the engine while its seat was taken"
        gated.knobs.gate.set()
        await asyncio.gather(holder, *tasks)
        # The user's header was ignored: it waits as normal, after boss's normal ones only by the fair share.
        assert texts(gated) == ["holder", "high2", "normal1", "ignored", "normal3", "low0"]
        async with aiohttp.ClientSession() as s:
            async with s.get(gw.url + "/stats", headers=ADMIN) as r:
                q = (await r.json())["queue"]
            async with s.get(gw.url + "/metrics") as r:
                metrics = await r.text()
        assert q["length"] == 0
        assert sum(row["ended"]["served"]["count"] for row in q["priorities"].values()) == 5
        assert 'shapegate_queue_wait_seconds_count{outcome="served",priority="normal"} 3.0' in metrics
    finally:
        await stop(gw)


async def test_a_flooding_key_waits_behind_the_others(gated):
    gw = await one_seat(gated)
    try:
        holder = await hold_the_seat(gw, gated)
        tasks = []
        for i in range(5):
            tasks.append(ask(gw, f"f{i}", key="flood"))
            await queued(gw, len(tasks))
        for i in range(2):
            tasks.append(ask(gw, f"u{i}", key="user"))
            await queued(gw, len(tasks))
        gated.knobs.gate.set()
        await asyncio.gather(holder, *tasks)
        assert texts(gated)[1:] == ["f0", "u0", "f1", "u1", "f2", "f3", "f4"]
    finally:
        await stop(gw)


async def test_a_deadline_that_cannot_be_met_is_refused_with_504_and_never_sent(gated):
    gw = await one_seat(gated)
    try:
        holder = await hold_the_seat(gw, gated)
        with pytest.raises(openai.APIStatusError) as e:
            await ask(gw, "late", headers={"x-shapegate-deadline-ms": "200"})
        assert e.value.status_code == 504
        assert e.value.body["code"] == "deadline_exceeded" and "x-shapegate-deadline-ms" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as bad:
            await ask(gw, "bad", headers={"x-shapegate-deadline-ms": "soon"})
        assert bad.value.body["param"] == "x-shapegate-deadline-ms"
        kept = ask(gw, "kept", headers={"x-shapegate-deadline-ms": "60000"})
        await queued(gw, 1)
        gated.knobs.gate.set()
        await asyncio.gather(holder, kept)
        assert texts(gated) == ["holder", "kept"], "the late and the bad one never reached the engine"
        q = gw.state.queue.report()
        assert q["priorities"]["normal"]["ended"]["deadline"]["count"] == 1
    finally:
        await stop(gw)


async def test_a_client_that_leaves_while_queued_is_removed_at_once_and_never_sent(gated):
    gw = await one_seat(gated)
    try:
        holder = await hold_the_seat(gw, gated)

        async def leaving() -> None:
            async with aiohttp.ClientSession() as s:
                body = {"model": "m", "messages": [{"role": "user", "content": "gone"}], "max_tokens": 4}
                await s.post(gw.url + "/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {USER_KEY}"})

        left = asyncio.create_task(leaving())
        await queued(gw, 1)
        left.cancel()  # the client closes its connection
        await queued(gw, 0)
        assert not gated.knobs.gate.is_set(), "removed while the seat was still taken, not when it freed"
        gated.knobs.gate.set()
        await holder
        await ask(gw, "after")
        assert texts(gated) == ["holder", "after"]
        assert gw.state.queue.report()["priorities"]["normal"]["ended"]["left"]["count"] == 1
    finally:
        await stop(gw)


@pytest.mark.parametrize("status, code", [(503, "server_is_overloaded"), (429, "rate_limit_exceeded")])
async def test_past_the_bounds_requests_are_refused_with_retry_after(gated, status, code):
    gw = await one_seat(gated, queue={"max_length": 1, "max_wait_s": 0.5},
                        admission={"status": status, "retry_after_s": 3})
    try:
        holder = await hold_the_seat(gw, gated)
        waiting = ask(gw, "waits")
        await queued(gw, 1)
        with pytest.raises(openai.APIStatusError) as full:  # the queue is full: at once
            await ask(gw, "no room")
        with pytest.raises(openai.APIStatusError) as waited:  # waited its longest
            await waiting
        for e in (full.value, waited.value):
            assert e.status_code == status and e.body["code"] == code
            assert e.response.headers["retry-after"] == "3"
        gated.knobs.gate.set()
        await holder
        assert texts(gated) == ["holder"]
        ends = gw.state.queue.report()["priorities"]["normal"]["ended"]
        assert ends["full"]["count"] == 1 and ends["timeout"]["count"] == 1
    finally:
        await stop(gw)


async def test_a_class_holds_no_more_than_its_share_of_the_seats_while_others_come_in(gated):
    gw = await start_gateway(config([backend("e", "openai", gated.url, {"m": "m"}, seats=2)],
                                    queue={"seat_shares": {"long_output": 0.5}}))
    try:
        gated.knobs.gate.set()
        await ask(gw, "d0")  # another class came in for the model: long outputs keep to their share
        gated.knobs.gate.clear()
        long1 = ask(gw, "long1", max_tokens=600)
        await until(lambda: "long1" in texts(gated))
        long2 = ask(gw, "long2", max_tokens=600)
        await queued(gw, 1)  # a seat is free, but not for a second long output
        d1 = ask(gw, "d1")
        await until(lambda: "d1" in texts(gated), "the other class took the free seat")
        assert texts(gated) == ["d0", "long1", "d1"] and gw.state.queue.length == 1
        gated.knobs.gate.set()
        await asyncio.gather(long1, long2, d1)
        assert texts(gated)[-1] == "long2"
    finally:
        await stop(gw)


async def test_every_api_waits_in_the_queue_and_is_served():
    engine = await sim("vllm", profile="r9700-vllm", serves=frozenset({"embeddings"}))
    gw = await start_gateway(config([backend("v", "vllm", engine.url, seats=1)]))
    oai = client(gw)
    claude = anthropic.AsyncAnthropic(base_url=gw.url, api_key=USER_KEY, max_retries=0)
    try:
        async with aiohttp.ClientSession() as s:
            holder = await hold_a_stream(s, gw, "m")  # streaming: the seat is taken
            calls = [
                oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4),
                oai.completions.create(model="m", prompt="hi", max_tokens=4),
                oai.embeddings.create(model="m", input="hi"),
                oai.responses.create(model="m", input="hi", max_output_tokens=4),
                claude.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}]),
            ]
            tasks = [asyncio.create_task(c) for c in calls]
            await queued(gw, len(tasks))
            # A background response is answered at once, and its run waits in the queue like the others.
            bg = await oai.responses.create(model="m", input="hi", max_output_tokens=4, background=True)
            assert bg.status == "queued"
            await queued(gw, len(tasks) + 1)
            assert all(not t.done() for t in tasks)
            holder.close()  # the holder's client leaves: its seat frees, and the queue's first takes it
            chat, completion, embedding, response, message = await asyncio.gather(*tasks)
            await until(lambda: gw.state.queue.length == 0)
            bg = await until(lambda: _done(oai, bg.id), "the background response done")
        assert chat.choices[0].message.content and completion.choices[0].text
        assert embedding.data[0].embedding
        assert response.output_text and message.content[0].text
        assert bg.output_text
        served = gw.state.queue.report()["priorities"]["normal"]["ended"]["served"]["count"]
        assert served == len(tasks) + 1
    finally:
        await claude.close()
        await stop(gw)
        await engine.close()


async def _done(oai: openai.AsyncOpenAI, rid: str):
    r = await oai.responses.retrieve(rid)
    return r if r.status in ("completed", "incomplete") else None  # (incomplete: its max_output_tokens)


async def test_a_run_time_keys_priority_orders_its_requests(gated):
    gw = await one_seat(gated)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + "/admin/keys", headers=ADMIN, json={"id": "rt", "priority": "high"}) as r:
                assert r.status == 201
                KEYS["rt"] = (await r.json())["key"]
            async with s.post(gw.url + "/admin/keys", headers=ADMIN, json={"priority": "urgent"}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "priority"
            async with s.get(gw.url + "/admin/keys", headers=ADMIN) as r:
                listed = {k["id"]: k for k in (await r.json())["data"]}
        assert listed["rt"]["priority"] == "high" and listed["boss"]["priority_header"] is True
        holder = await hold_the_seat(gw, gated)
        normal = ask(gw, "n0")
        await queued(gw, 1)
        high = ask(gw, "r0", key="rt")
        await queued(gw, 2)
        gated.knobs.gate.set()
        await asyncio.gather(holder, normal, high)
        assert texts(gated) == ["holder", "r0", "n0"]
    finally:
        KEYS.pop("rt", None)
        await stop(gw)


async def test_an_interactive_backend_keeps_its_seats_for_the_sessions_that_use_it(gated):
    llama = await sim("llamacpp", slots=2)
    gw = await start_gateway(config([backend("v", "openai", gated.url, {"m": "m"}, seats=1),
                                     backend("ll", "llamacpp", llama.url, interactive=True)]))
    try:
        ll = gw.state.pool.get("ll")
        await until(lambda: ll.load is not None and ll.load.total_slots == 2, "llama.cpp's slots scraped")
        c = client(gw)
        for sid in ("s1", "s2"):  # two sessions use it: both its slots are theirs
            stream = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "turn"}],
                                                     max_tokens=4, stream=True, extra_headers={"x-session-id": sid})
            [chunk async for chunk in stream]
        holder = await hold_the_seat(gw, gated)  # (to v: llama.cpp's slots are kept for the sessions)
        other = ask(gw, "agent")
        await queued(gw, 1)  # llama.cpp has two idle slots, both kept for the sessions: it waits for v
        gated.knobs.gate.set()
        await asyncio.gather(holder, other)
        assert texts(gated)[-1] == "agent"
    finally:
        await stop(gw)
        await llama.close()



async def test_a_reload_that_turns_the_queue_off_lets_the_waiting_requests_go_on(gated):
    from gateway.config import parse_config
    from gateway.ops.reload import apply
    from gateway.runtime import build_policy

    gw = await one_seat(gated)
    try:
        holder = await hold_the_seat(gw, gated)
        waiting = ask(gw, "waiting")
        await queued(gw, 1)
        off = config([backend("e", "openai", gated.url, {"m": "m"}, seats=1)], queue={"enabled": False})
        apply(gw.state, parse_config(off, build_policy))
        await until(lambda: texts(gated) == ["holder", "waiting"], "the waiting request sent on, as without a queue")
        assert gw.state.queue.length == 0
        gated.knobs.gate.set()
        await asyncio.gather(holder, waiting)
    finally:
        await stop(gw)


async def test_a_messages_client_gets_the_queues_refusals_in_anthropics_shape():
    engine = await sim("vllm", profile="r9700-vllm")
    gw = await start_gateway(config([backend("v", "vllm", engine.url, seats=1)], queue={"max_length": 1}))
    claude = anthropic.AsyncAnthropic(base_url=gw.url, api_key=USER_KEY, max_retries=0)
    msg = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    try:
        async with aiohttp.ClientSession() as s:
            body = {"model": "m", "messages": [{"role": "user", "content": "hold"}], "max_tokens": 3000,
                    "stream": True}
            holder = await s.post(gw.url + "/v1/chat/completions", json=body,
                                  headers={"Authorization": f"Bearer {USER_KEY}"})
            await holder.content.readany()
            with pytest.raises(anthropic.APIStatusError) as late:
                await claude.messages.create(**msg, extra_headers={"x-shapegate-deadline-ms": "100"})
            assert late.value.status_code == 504 and late.value.body["error"]["type"] == "timeout_error"
            waiting = asyncio.create_task(claude.messages.create(**msg))
            await queued(gw, 1)
            with pytest.raises(anthropic.APIStatusError) as full:
                await claude.messages.create(**msg)
            assert full.value.status_code == 529 and full.value.body["error"]["type"] == "overloaded_error"
            assert full.value.response.headers["retry-after"] == "1"
            holder.close()
            assert (await waiting).content[0].text
    finally:
        await claude.close()
        await stop(gw)
        await engine.close()


async def test_a_request_that_waited_long_goes_before_higher_priorities(gated):
    gw = await one_seat(gated, queue={"promote_after_s": 0.3})
    try:
        holder = await hold_the_seat(gw, gated)
        old = ask(gw, "old", key="boss", headers={"x-shapegate-priority": "low"})
        await queued(gw, 1)
        await asyncio.sleep(0.5)  # past promote_after_s
        new = ask(gw, "new", key="boss", headers={"x-shapegate-priority": "high"})
        await queued(gw, 2)
        gated.knobs.gate.set()
        await asyncio.gather(holder, old, new)
        assert texts(gated) == ["holder", "old", "new"]
    finally:
        await stop(gw)


async def test_a_backend_without_a_seat_still_takes_a_failover(gated):
    other = await FakeEngine().start()
    gw = await start_gateway(config([backend("full", "openai", gated.url, {"m": "m", "only-full": "m"}, seats=1),
                                     backend("open", "openai", other.url, {"m": "m"})],
                                    health={"interval_s": 30.0}))  # (probes would not notice in time)
    try:
        holder = asyncio.create_task(client(gw).chat.completions.create(
            model="only-full", messages=[{"role": "user", "content": "holder"}], max_tokens=4))
        await until(lambda: texts(gated) == ["holder"])
        await other.stop()  # the one open backend refuses connections now
        raw = asyncio.create_task(client(gw).chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "failed over"}], max_tokens=4))
        await until(lambda: texts(gated) == ["holder", "failed over"], "sent on to the full backend's own queue")
        gated.knobs.gate.set()
        await holder
        reply = await raw
        assert reply.headers["x-shapegate-backend"] == "full" and "failover from open" in reply.headers[
            "x-shapegate-reason"]
    finally:
        await stop(gw)


async def test_a_background_response_fails_over_to_a_backend_without_a_seat():
    full, gone = await sim("vllm"), await sim("vllm")
    gw = await start_gateway(config([backend("full", "vllm", full.url, {"m": "sim-model", "only-full": "sim-model"},
                                             seats=1),
                                     backend("open", "vllm", gone.url)],
                                    health={"interval_s": 30.0}))  # (probes would not notice in time)
    oai = client(gw)
    try:
        async with aiohttp.ClientSession() as s:
            holder = await hold_a_stream(s, gw, "only-full")  # streaming: the full backend's one seat is taken
            await gone.close()  # the one open backend refuses connections now
            bg = await oai.responses.create(model="m", input="hi", max_output_tokens=4, background=True)
            bg = await until(lambda: _ended(oai, bg.id), "the background response ended")
            holder.close()
        assert bg.status in ("completed", "incomplete"), bg.error  # sent on to the full backend's own queue
        assert bg.output_text
    finally:
        await stop(gw)
        await full.close()


async def _ended(oai: openai.AsyncOpenAI, rid: str):
    r = await oai.responses.retrieve(rid)
    return r if r.status not in ("queued", "in_progress") else None


async def test_a_request_with_only_interactive_backends_is_not_kept_from_their_seats():
    llama = await sim("llamacpp", slots=1)
    gw = await start_gateway(config([backend("ll", "llamacpp", llama.url, interactive=True)],
                                    queue={"max_wait_s": 3.0}))
    try:
        ll = gw.state.pool.get("ll")
        await until(lambda: ll.load is not None and ll.load.total_slots == 1, "llama.cpp's slots scraped")
        c = client(gw)
        stream = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "turn"}],
                                                 max_tokens=4, stream=True, extra_headers={"x-session-id": "s1"})
        [chunk async for chunk in stream]  # a session uses its one slot: kept for it, but nowhere else to go
        reply = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "agent"}],
                                                max_tokens=4)
        assert reply.choices[0].message.content
        assert gw.state.queue.length == 0
    finally:
        await stop(gw)
        await llama.close()
