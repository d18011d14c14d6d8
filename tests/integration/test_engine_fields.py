"""llama.cpp's `timings` through a real gateway: dropped from replies and stream chunks by default, kept for a
backend whose engine_private_fields says so."""

from __future__ import annotations

import aiohttp
import orjson

from gateway.sim.runner import SimOptions, start_sim
from tests.gateway_harness import USER_KEY, gateway_config, start_gateway

MSG = [{"role": "user", "content": "hi"}]


async def replies(url: str, model: str) -> dict[str, list[dict]]:
    """Each way of asking: the reply objects (a stream's events) the client gets."""
    bodies = {
        "chat": {"messages": MSG},
        "chat stream": {"messages": MSG, "stream": True},
        "chat stream with usage": {"messages": MSG, "stream": True, "stream_options": {"include_usage": True}},
        "completions": {"prompt": "hi"},
        "completions stream": {"prompt": "hi", "stream": True},
    }
    got = {}
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {USER_KEY}"}) as s:
        for name, body in bodies.items():
            route = "/v1/chat/completions" if name.startswith("chat") else "/v1/completions"
            async with s.post(url + route, json={"model": model, "max_tokens": 4, **body}) as r:
                raw = await r.read()
                assert r.status == 200, raw
            events = [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: {")] if body.get("stream") else [raw]
            got[name] = [orjson.loads(e) for e in events]
    return got


async def test_timings_are_dropped_unless_the_backend_keeps_them():
    sims = [await start_sim(SimOptions(engine="llamacpp", model=m)) for m in ("dropped", "kept")]
    gw = await start_gateway(gateway_config([
        {"id": "d", "engine": "llamacpp", "url": sims[0].url, "models": ["dropped"]},
        {"id": "k", "engine": "llamacpp", "url": sims[1].url, "models": ["kept"], "engine_private_fields": True},
    ]))
    try:
        dropped, kept = await replies(gw.url, "dropped"), await replies(gw.url, "kept")
    finally:
        await gw.stop()
        for s in sims:
            await s.close()
    for name, objs in dropped.items():
        assert not any("timings" in o for o in objs), name
        assert {o["model"] for o in objs} == {"dropped"}, name  # and the rewrite of the model name still happens
    # Kept: wherever llama.cpp puts them (on a stream, the last chunk it sends the client; a chat stream's
    # timings ride on the usage chunk the gateway asked for, which the client gets only when it asked too).
    assert "timings" in kept["chat"][0] and "timings" in kept["completions"][0]
    assert "timings" in kept["chat stream with usage"][-1] and "timings" in kept["completions stream"][-1]
    assert set(dropped["chat"][0]) == set(kept["chat"][0]) - {"timings"}  # nothing else of the reply goes
