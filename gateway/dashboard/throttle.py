"""Failed dashboard sign-ins per client address: a small token bucket each, in bounded memory."""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable

# Ten wrong keys at once, then one every six seconds: plenty for a person who mistyped, nothing for a guesser.
SIGN_IN_BURST = 10
SIGN_IN_PER_MINUTE = 10.0
# Addresses remembered at most (about 100 bytes each); past it the longest quiet one is forgotten.
SIGN_IN_ADDRESSES = 4096


def address_key(address: str) -> str:
    """Whom a bucket is for: the IPv4 address, or the /64 of an IPv6 one (one host usually holds a whole /64)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address[:64]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class SignInThrottle:
    """Each failed sign-in takes a token from its address's bucket; with none left, sign-ins from that address
    wait (429) until one has come back, right key or not, so that waiting tells a guesser nothing.

    Per process: with several workers or replicas each one keeps its own buckets.
    """

    def __init__(self, burst: int = SIGN_IN_BURST, per_minute: float = SIGN_IN_PER_MINUTE,
                 max_addresses: int = SIGN_IN_ADDRESSES, clock: Callable[[], float] = time.monotonic) -> None:
        self.burst = float(burst)
        self.rate = per_minute / 60.0
        self.max_addresses = max_addresses
        self.clock = clock
        # address key -> (tokens, when counted); least recently failed first
        self._buckets: dict[str, tuple[float, float]] = {}

    def _tokens(self, key: str, now: float) -> float:
        tokens, at = self._buckets.get(key, (self.burst, now))
        return min(self.burst, tokens + (now - at) * self.rate)

    def retry_after(self, address: str) -> float:
        """Seconds until `address` may try again; 0 when it may now."""
        tokens = self._tokens(address_key(address), self.clock())
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate

    def failed(self, address: str) -> None:
        key, now = address_key(address), self.clock()
        tokens = self._tokens(key, now) - 1.0
        self._buckets.pop(key, None)  # re-inserted last: the dict stays in order of the latest failure
        if len(self._buckets) >= self.max_addresses:
            self._forget(now)
        self._buckets[key] = (tokens, now)

    def _forget(self, now: float) -> None:
        # From the longest quiet address on: buckets full again hold nothing worth keeping (a few steps each
        # time, the oldest come first); if the first is not full, it goes all the same.
        stale = []
        for k in self._buckets:
            if self._tokens(k, now) < self.burst:
                break
            stale.append(k)
        for k in stale:
            del self._buckets[k]
        if len(self._buckets) >= self.max_addresses:
            del self._buckets[next(iter(self._buckets))]

    def __len__(self) -> int:
        return len(self._buckets)
