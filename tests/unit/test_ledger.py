"""The usage ledger's rules (what an attempt used, one row per key, model, API, backend and hour) and its report."""

from __future__ import annotations

import time

import pytest

from gateway.config_usage import ModelPrice
from gateway.contracts import CLIENT_ERROR, CLIENT_LEFT, ENGINE_ERROR, OK, Outcome, RequestShape
from gateway.stats.ledger import COUNTS, Ledger, tokens_of
from gateway.stats.ledger_report import build, cost_of, parse_time

SHAPE = RequestShape("m", "chat", True, prompt_tokens=40, output_tokens=100, klass="default", principal="k")


def outcome(result: str = OK, status: int = 200, ttft: float | None = 0.01, prompt: int = 50, completion: int = 20,
            cached: int = 0, backend: str = "b") -> Outcome:
    return Outcome(backend, SHAPE, result == OK, status, ttft=ttft, prompt_tokens=prompt,
                   completion_tokens=completion, cached_tokens=cached, result=result)


@pytest.mark.parametrize("o, api, used", [
    (outcome(), "chat", (50, 0, 20)),  # served: the engine's usage
    (outcome(ttft=None), "embeddings", (50, 0, 20)),  # served without a stream
    # The client left a stream: what was relayed until then (the outcome holds the tokens seen).
    (outcome(CLIENT_LEFT, 499, completion=7), "chat", (50, 0, 7)),
    # A stream that broke after its first token: what it relayed.
    (outcome(ENGINE_ERROR, 502, completion=3), "chat", (50, 0, 3)),
    # Failed before its first byte (failed over, or the last error): nothing reached the client.
    (outcome(ENGINE_ERROR, 502, ttft=None, completion=0), "chat", (0, 0, 0)),
    (outcome(CLIENT_ERROR, 400, ttft=None, completion=0), "chat", (0, 0, 0)),
    (outcome(CLIENT_LEFT, 499, ttft=None, completion=0), "chat", (0, 0, 0)),
    # Anthropic's input_tokens leave out the tokens read from the cache: the ledger's prompt holds them.
    (outcome(prompt=30, cached=64), "messages", (94, 64, 20)),
    (outcome(prompt=94, cached=64), "chat", (94, 64, 20)),
    # A stored response read back repeats its usage: counted once, when it was made.
    (outcome(ttft=None), "response", (0, 0, 0)),
    (outcome(ttft=None), "count_tokens", (0, 0, 0)),
])
def test_what_an_attempt_used(o, api, used):
    assert tokens_of(o, api) == used


def test_rows_by_key_model_api_backend_and_hour_with_shadow_copies_apart():
    ledger = Ledger()
    ledger.served("k", "m", "chat", outcome())
    ledger.served("k", "m", "chat", outcome(ENGINE_ERROR, 502, ttft=None, completion=0))
    ledger.served("k", "m", "messages", outcome(prompt=30, cached=64, backend="c"))
    ledger.shadow("k", "m", "chat", outcome(backend="s"))
    ledger.refused("k", "", "chat")
    rows = ledger.take()
    hour = int(time.time() // 3600)
    named = {row: dict(zip(COUNTS, counts)) for row, counts in rows.items()}
    chat = named[(hour, "k", "m", "chat", "b")]
    assert (chat["requests"], chat["errors"], chat["prompt_tokens"], chat["completion_tokens"]) == (2, 1, 50, 20)
    messages = named[(hour, "k", "m", "messages", "c")]
    assert (messages["prompt_tokens"], messages["cached_tokens"]) == (94, 64)
    shadow = named[(hour, "k", "m", "chat", "s")]
    assert shadow["requests"] == 0 and shadow["shadow_requests"] == 1 and shadow["shadow_completion_tokens"] == 20
    assert named[(hour, "k", "", "chat", "")]["refused"] == 1
    assert ledger.take() == {} and len(ledger) == 0


def test_report_groups_filters_and_prices():
    h = 480_000  # 2024-10-04T00:00Z
    rows = {(h, "a", "m", "chat", "b1"): [2, 1000, 400, 100, 1, 0, 0, 0, 0, 0, 0],
            (h + 1, "a", "m", "responses", "b2"): [1, 500, 0, 50, 0, 0, 0, 0, 0, 0, 0],
            (h + 25, "b", "m", "chat", "b1"): [3, 300, 0, 30, 0, 2, 1, 100, 0, 10, 0],
            (h + 25, "b", "other", "chat", "b1"): [1, 10, 0, 1, 0, 0, 0, 0, 0, 0, 0]}
    prices = {"m": ModelPrice(input_per_million=1.0, output_per_million=4.0, cached_input_per_million=0.5)}
    by_key = build(rows, ("key",), {}, prices)
    assert [r["key"] for r in by_key["rows"]] == ["b", "a"]  # busiest first
    assert by_key["keys"]["a"]["requests"] == 3 and by_key["keys"]["a"]["prompt_tokens"] == 1500
    assert by_key["keys"]["a"]["cost"] == pytest.approx((600 + 400 * 0.5 + 100 * 4 + 500 + 50 * 4) / 1e6)
    assert by_key["unpriced_models"] == ["other"] and by_key["totals"]["shadow_requests"] == 1
    by_day = build(rows, ("day", "api"), {"key": "a"}, {})
    assert [(r["day"], r["api"], r["requests"]) for r in by_day["rows"]] == [("2024-10-04", "chat", 2),
                                                                          ("2024-10-04", "responses", 1)]
    assert "cost" not in by_day["totals"] and list(by_day["keys"]) == ["a"]
    by_hour = build(rows, ("hour",), {"backend": "b1"}, {})
    assert [r["hour"] for r in by_hour["rows"]] == ["2024-10-04T00:00Z", "2024-10-05T01:00Z"]


def test_cost_of_a_row_leaves_out_shadow_copies():
    price = ModelPrice(input_per_million=2.0, output_per_million=8.0)
    assert cost_of([1, 1_000_000, 0, 500_000, 0, 0, 5, 9_000_000, 0, 9_000_000, 0], price) == pytest.approx(6.0)
    assert cost_of([1, 100, 0, 100, 0, 0, 0, 0, 0, 0, 0], None) == 0.0


@pytest.mark.parametrize("text, seconds", [
    ("1717200000", 1717200000.0), ("2024-06-01", 1717200000.0), ("2024-06-01T01:00Z", 1717203600.0),
    ("2024-06-01T03:00+02:00", 1717203600.0), ("24h", 1_000_000.0 - 86400), ("7d", 1_000_000.0 - 7 * 86400),
    ("90m", 1_000_000.0 - 5400)])
def test_times_a_client_may_give(text, seconds):
    assert parse_time(text, now=1_000_000.0) == seconds


@pytest.mark.parametrize("text", ["", "yesterday", "7w", "2024-13-01", "-5h", "1e400"])
def test_times_that_are_not(text):
    with pytest.raises(ValueError):
        parse_time(text, now=0.0)


def test_a_reload_keeps_the_ledger_switch_and_traces_until_a_restart():
    from gateway.config import parse_config
    from gateway.ops.reload import plan
    from gateway.runtime import build_policy

    base = {"auth": {"enabled": False}, "backends": [{"id": "a", "engine": "vllm", "url": "http://x:1",
                                                      "models": ["m"]}]}
    old = parse_config(base, build_policy)
    new = parse_config({**base, "usage": {"enabled": False, "retention_days": 7},
                        "observe": {"traces": True}}, build_policy)
    assert plan(old, new).restart_needed == ["usage.enabled", "observe"]
