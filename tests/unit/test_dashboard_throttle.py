"""The dashboard's sign-in throttle: per address (an IPv6 /64 as one), refills with time, bounded memory."""

from __future__ import annotations

from gateway.dashboard.throttle import SIGN_IN_BURST, SignInThrottle, address_key


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_burst_of_failures_then_one_per_interval() -> None:
    clock = Clock()
    t = SignInThrottle(clock=clock)
    for _ in range(SIGN_IN_BURST):
        assert t.retry_after("192.0.2.1") == 0
        t.failed("192.0.2.1")
    assert 5.9 < t.retry_after("192.0.2.1") <= 6.0
    assert t.retry_after("192.0.2.2") == 0  # another address is not held back
    clock.t += 6.0
    assert t.retry_after("192.0.2.1") == 0
    t.failed("192.0.2.1")
    assert t.retry_after("192.0.2.1") > 5.9


def test_an_ipv6_slash_64_is_one_address() -> None:
    assert address_key("2001:db8:1:2:aaaa::1") == address_key("2001:db8:1:2:bbbb::2") == "2001:db8:1:2::/64"
    assert address_key("2001:db8:1:3::1") != address_key("2001:db8:1:2::1")
    assert address_key("::ffff:192.0.2.7") == "192.0.2.7"
    assert address_key("fe80::1%eth0") == "fe80::/64"
    assert address_key("") == "" and address_key("not an address" * 10) == ("not an address" * 10)[:64]


def test_memory_is_bounded_and_full_buckets_go_first() -> None:
    clock = Clock()
    t = SignInThrottle(max_addresses=100, clock=clock)
    for i in range(100):
        t.failed(f"10.0.0.{i}")
    clock.t += 3600  # every bucket full again: nothing worth keeping
    for i in range(1000):
        t.failed(f"10.1.{i // 250}.{i % 250}")
        assert len(t) <= 100
    assert len(t) == 100
    # Past the bound with no bucket full again, the longest quiet address is the one forgotten.
    t = SignInThrottle(max_addresses=3, clock=clock)
    for address in ("10.2.0.1", "10.2.0.2"):
        for _ in range(SIGN_IN_BURST):
            t.failed(address)
    t.failed("10.2.0.3")
    clock.t += 1.0
    t.failed("10.2.0.1")  # its latest failure: no longer the quietest
    t.failed("10.2.0.4")
    assert len(t) == 3 and t.retry_after("10.2.0.1") > 0
    assert t.retry_after("10.2.0.2") == 0  # forgotten (it would still wait 5 s otherwise)
