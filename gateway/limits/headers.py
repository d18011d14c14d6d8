"""OpenAI's x-ratelimit headers of the minute limits: durations as OpenAI writes them, each kind's triple from its
tightest bucket, as reply-head lines or as headers."""

from __future__ import annotations

from collections.abc import Sequence
from math import floor
from typing import Final

from gateway.limits.buckets import KINDS, Need


def duration(seconds: float) -> str:
    """A duration as OpenAI's headers write it (Go's notation, to the millisecond): 20ms, 1s, 1.5s, 6m0s."""
    return duration_ms(int(seconds * 1000 + 0.5))


def duration_ms(ms: int) -> str:
    if ms < 1000:
        return f"{ms}ms" if ms > 0 else "0s"
    s, frac = divmod(ms, 1000)
    text = f"{s % 60}.{frac:03d}".rstrip("0") + "s" if frac else f"{s % 60}s"
    if s < 60:
        return text
    h, m = divmod(s // 60, 60)
    return f"{h}h{m}m{text}" if h else f"{m}m{text}"


# The texts of durations under a minute, by part, for the x-ratelimit-reset headers every reply of a limited key
# carries: list indexes instead of formatting. A bucket's reset is at most a minute unless usage overdrew it.
MS_TEXTS: Final = tuple(duration_ms(ms) for ms in range(1000))  # "0s", "1ms" ... "999ms"
SECOND_TEXTS: Final = tuple(str(s) for s in range(60))
FRACTION_TEXTS: Final = tuple(f".{ms:03d}".rstrip("0") + "s" if ms else "s" for ms in range(1000))  # "s", ".001s" ... ".999s"


def reset_text(ms: int) -> str:
    """duration_ms(ms), from the tables when under a minute."""
    if ms < 1000:
        return MS_TEXTS[ms] if ms > 0 else "0s"
    if ms < 60000:
        return SECOND_TEXTS[ms // 1000] + FRACTION_TEXTS[ms % 1000]
    return duration_ms(ms)


HEADER_NAMES: Final = {kind: (f"x-ratelimit-limit-{kind}", f"x-ratelimit-remaining-{kind}", f"x-ratelimit-reset-{kind}")
                for kind in KINDS}
# The same triple as reply-head lines: the text before each of the three values.
LINE_PARTS: Final = {kind: (f"{limit}: ", f"\r\n{remaining}: ", f"\r\n{reset}: ")
              for kind, (limit, remaining, reset) in HEADER_NAMES.items()}


def kind_lines(parts: tuple[str, str, str], limit: str, cap: float, level: float) -> str:
    """The x-ratelimit triple of one kind as reply-head lines, from its bucket (`limit`: cap's text): what it
    holds now (none when in debt) and the time until it is full. The one place they are written."""
    a, b, c = parts
    # floor() rather than int(), in a third of the time: the same text (a reset below zero reads 0s either way)
    ms = floor((cap - level) * 60000.0 / cap + 0.5)
    return f"{a}{limit}{b}{floor(level) if level > 0 else 0}{c}{reset_text(ms)}\r\n"


def tightest(needs: tuple[Need, ...], caps: tuple[float, ...], levels: Sequence[float]) -> list[int]:
    """Each kind's tightest bucket, kinds in the order the needs name them: the least remaining, then the longest
    until full."""
    found: dict[str, int] = {}
    for i, n in enumerate(needs):
        j = found.get(n.kind)
        if j is None or (levels[i] // 1, (levels[i] - caps[i]) / caps[i]) < (levels[j] // 1,
                                                                           (levels[j] - caps[j]) / caps[j]):
            found[n.kind] = i
    return list(found.values())


def lines(needs: tuple[Need, ...], caps: tuple[float, ...], levels: Sequence[float]) -> str:
    """The x-ratelimit triple of each kind the key is limited in, from that kind's tightest bucket, as lines."""
    return "".join([kind_lines(LINE_PARTS[needs[i].kind], str(int(caps[i])), caps[i], levels[i])
                    for i in tightest(needs, caps, levels)])


def headers(needs: tuple[Need, ...], caps: tuple[float, ...], levels: Sequence[float]) -> dict[str, str]:
    """lines() as headers (what an error reply carries)."""
    out: dict[str, str] = {}
    for line in lines(needs, caps, levels).split("\r\n"):
        if line:
            name, _, value = line.partition(": ")
            out[name] = value
    return out
