"""Who used what: each request counted per key, model, API, backend and hour, in memory until the next flush.

The request's end (Gateway.finish) and each shadow copy add to a row here: a dict lookup and a few additions, no
I/O. A background loop (gateway/stats/ledger_store.py) takes the rows about once a second and adds them to the
store, this process's memory or Redis, where they are kept for `[usage] retention_days`.
"""

from __future__ import annotations

import time
from typing import Final

from gateway.contracts import CLIENT_ERROR, ENGINE_ERROR, Outcome

# The counts of one row, in this order. `requests` are the requests that reached an engine, counted once at the
# backend of their last attempt (a failover is one request); `errors` are those of them that did not end well
# (an engine's failure, or the engine refusing the request); `refused` were refused before any engine (rate
# limits, no capacity). Tokens are the engine's own usage, and for a stream the client left, the tokens relayed
# until then. Shadow copies of a request are counted apart, in the shadow_ counts of the key they copy.
COUNTS: Final[tuple[str, ...]] = (
    "requests", "prompt_tokens", "cached_tokens", "completion_tokens", "errors", "refused",
    "shadow_requests", "shadow_prompt_tokens", "shadow_cached_tokens", "shadow_completion_tokens", "shadow_errors")
REQUESTS: Final = 0
PROMPT: Final = 1
CACHED: Final = 2
COMPLETION: Final = 3
ERRORS: Final = 4
REFUSED: Final = 5
SHADOW: Final = 6  # the shadow counts are the first five, this far further on
N_COUNTS: Final = len(COUNTS)

# The routes that use no tokens of an engine's: a stored response read back, deleted or cancelled (its usage was
# counted when it was made, and the reply repeats it), and the token counting routes.
NO_TOKENS: Final[frozenset[str]] = frozenset({"response", "response_cancel", "responses_input_tokens",
                                              "count_tokens"})

# (hour, key id, model, API, backend): the hour counts from the epoch (UTC); the model is a served public name or
# "" (a refusal of a model the gateway does not serve), the backend "" for a refusal.
Row = tuple[int, str, str, str, str]


def tokens_of(o: Outcome, api: str) -> tuple[int, int, int]:
    """(prompt, cached prompt, completion) tokens an attempt used: none unless the engine served it or streamed
    some output (an attempt that failed before its first byte used nothing the client got, and its next candidate
    counts the request), none on the routes that use no tokens. Anthropic's input_tokens leave out the tokens read
    from the cache; the ledger's prompt tokens hold them, as every other API's do."""
    if api in NO_TOKENS or not (o.ok or o.ttft is not None):
        return 0, 0, 0
    cached = o.cached_tokens
    prompt = o.prompt_tokens + cached if api == "messages" else o.prompt_tokens
    return prompt, cached, o.completion_tokens


class Ledger:
    """The rows counted since the last flush. Bounded by what can name a row: an authenticated key, a served
    model, a route, a configured backend, the hour."""

    __slots__ = ("_rows", "_hour", "_hour_ends")

    def __init__(self) -> None:
        self._rows: dict[Row, list[int]] = {}
        self._hour = 0
        self._hour_ends = 0.0

    def _row(self, key: str, model: str, api: str, backend: str) -> list[int]:
        now = time.time()
        if now >= self._hour_ends or now < self._hour_ends - 3600.0:  # (a clock set back: the hour again)
            self._hour = int(now // 3600.0)
            self._hour_ends = (self._hour + 1) * 3600.0
        row = (self._hour, key, model, api, backend)
        counts = self._rows.get(row)
        if counts is None:
            counts = self._rows[row] = [0] * N_COUNTS
        return counts

    def served(self, key: str, model: str, api: str, o: Outcome) -> None:
        """A request of `key` that reached an engine ended, `o` its last attempt."""
        self._add(self._row(key, model, api, o.backend), 0, o, api)

    def shadow(self, key: str, model: str, api: str, o: Outcome) -> None:
        """A shadow copy of a request of `key` ended (its usage is the operator's, not the key's)."""
        self._add(self._row(key, model, api, o.backend), SHADOW, o, api)

    def refused(self, key: str, model: str, api: str) -> None:
        """A request of `key` was refused before any engine was tried."""
        self._row(key, model, api, "")[REFUSED] += 1

    @staticmethod
    def _add(counts: list[int], at: int, o: Outcome, api: str) -> None:
        counts[at + REQUESTS] += 1
        if o.result == ENGINE_ERROR or o.result == CLIENT_ERROR:
            counts[at + ERRORS] += 1
        prompt, cached, completion = tokens_of(o, api)
        counts[at + PROMPT] += prompt
        counts[at + CACHED] += cached
        counts[at + COMPLETION] += completion

    def take(self) -> dict[Row, list[int]]:
        """The rows counted since the last take, for the store; counting starts again."""
        rows = self._rows
        if rows:
            self._rows = {}
        return rows

    def __len__(self) -> int:
        return len(self._rows)
