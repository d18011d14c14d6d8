"""A/B experiments on the Responses and Messages APIs, through the official clients: split arms keep a conversation
and measure it, shadow copies go out in each API's form and their outputs are compared."""

from __future__ import annotations

import anthropic
import openai

from tests.gateway_harness import USER_KEY, gateway_config, start_gateway
from tests.kit import until

MODEL = "m"


def _cfg(engines, experiment: dict) -> dict:
    backends = [{"id": f"e{i}", "engine": "vllm", "url": e.url, "models": [MODEL]} for i, e in enumerate(engines)]
    return gateway_config(backends) | {"experiments": [{"model": MODEL, **experiment}]}


def _headers(seen) -> dict[str, str]:
    """A request's headers as the engine saw them, by lower-case name."""
    return {k.lower(): v for k, v in seen[2].items()}


def _clients(gw):
    return (openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=USER_KEY, max_retries=0),
            anthropic.AsyncAnthropic(base_url=gw.url, api_key=USER_KEY, max_retries=0))


async def test_split_arms_keep_a_session_across_both_apis_and_measure_its_streams(api_engines):
    gw = await start_gateway(_cfg(api_engines, {
        "name": "ab", "mode": "split", "subject": "user",
        "arms": [{"name": "a", "backends": ["e0"], "weight": 50}, {"name": "b", "backends": ["e1"], "weight": 50}]}))
    oai, claude = _clients(gw)
    try:
        arms_of: dict[str, set[str]] = {}
        for s in range(12):
            h = {"x-session-id": f"conv-{s}"}
            raw = await oai.responses.with_raw_response.create(model=MODEL, input="hi", extra_headers=h)
            text = raw.parse().output_text
            arm = raw.headers["x-shapegate-arm"]
            assert text.startswith(f"{arm}0")  # the arm's own engine answered (arm a is engine a)
            raw2 = await claude.messages.with_raw_response.create(
                model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}], extra_headers=h)
            assert (await raw2.parse()).content[0].text.startswith(f"{raw2.headers['x-shapegate-arm']}0")
            arms_of[f"conv-{s}"] = {arm, raw2.headers["x-shapegate-arm"]}
        assert all(len(a) == 1 for a in arms_of.values())  # one conversation, one arm, whichever API it speaks
        assert set().union(*arms_of.values()) == {"a", "b"}
        # Streams are measured as the arm's: first token and inter-token latency from each API's own events.
        h = {"x-session-id": "conv-0"}
        arm = next(iter(arms_of["conv-0"]))
        events = await oai.responses.create(model=MODEL, input="hi", extra_headers=h, stream=True)
        assert "".join([e.delta async for e in events if e.type == "response.output_text.delta"]).startswith(f"{arm}0")
        async with claude.messages.stream(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}],
                                          extra_headers=h) as stream:
            assert (await stream.get_final_text()).startswith(f"{arm}0")
        x = gw.state.experiments.by_name["ab"]
        assert sum(x.classes[a, "all"].requests for a in ("a", "b") if (a, "all") in x.classes) == 26
        assert len(x.classes[arm, "all"].samples["ttft"].values) == 2
        assert len(x.classes[arm, "all"].samples["itl"].values) == 2
    finally:
        await oai.close()
        await claude.close()
        await gw.stop()


async def test_shadow_copies_in_each_apis_form_compared_on_their_text(api_engines):
    primary, cand = api_engines
    gw = await start_gateway(_cfg(api_engines, {
        "name": "sh", "mode": "shadow", "arms": [{"name": "candidate", "backends": ["e1"]}]}))
    oai, claude = _clients(gw)
    x = gw.state.experiments.by_name["sh"]

    def copies() -> list:
        return [s for s in cand.knobs.seen if _headers(s).get("x-shapegate-shadow") == "sh"]

    async def ask_all() -> None:
        for stream in (False, True):
            r = await oai.responses.create(model=MODEL, input="hi", temperature=0, stream=stream)
            if stream:
                async for _ in r:
                    pass
            m = await claude.messages.create(model=MODEL, max_tokens=8, extra_body={"temperature": 0}, stream=stream,
                                             messages=[{"role": "user", "content": "hi"}])
            if stream:
                async for _ in m:
                    pass

    try:
        await ask_all()
        await until(lambda: x.agreement["candidate"].compared == 4, timeout=5)
        assert x.agreement["candidate"].exact == 0  # engine b says "b0 b1 ...", the primary "a0 a1 ...": compared
        assert not any(_headers(s).get("x-shapegate-shadow") for s in primary.knobs.seen)  # the primary got no copy
        sent = copies()
        assert len(sent) == 4 and all(_headers(s)["x-request-id"].endswith(".shadow") for s in sent)
        resp_copies = [s for s in sent if s[1] == "/v1/responses"]
        assert len(resp_copies) == 2 and all(b'"store":false' in s[3] for s in resp_copies)
        assert not cand.knobs.stored  # a copy's response is never stored on the candidate
        msg_copies = [s for s in sent if s[1] == "/v1/messages"]
        assert len(msg_copies) == 2 and all(_headers(s).get("anthropic-version") for s in msg_copies)

        cand.knobs.name = "a"  # now the candidate says what the primary says
        await ask_all()
        await until(lambda: x.agreement["candidate"].compared == 8, timeout=5)
        assert x.agreement["candidate"].exact == 4
        assert sorted(x.agreement["candidate"].prefix_tokens.values) == [0.0, 0.0, 5.0, 5.0]  # streams: 5 tokens

        # A request that continues a stored response is expanded by the gateway first: its copy is the whole
        # conversation, which means the same to the candidate, and asks it to keep nothing.
        first = await oai.responses.create(model=MODEL, input="hi first")
        await oai.responses.create(model=MODEL, input="more", previous_response_id=first.id)
        await until(lambda: len(copies()) == 10, timeout=5)
        assert x.shadow_counts["candidate", "sent"] == 10
        last = copies()[-1][3]
        assert b"hi first" in last and b"more" in last and b'"store":false' in last
        assert b"previous_response_id" not in last
    finally:
        await oai.close()
        await claude.close()
        await gw.stop()
