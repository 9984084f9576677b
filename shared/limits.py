"""Per-client limits, pure: token buckets for write and create rates, live-connection
counts, and who the client is. The aiohttp glue is shared/http/limits.py."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address, ip_network
from typing import Final

MAX_CLIENTS: Final = 100_000  # per limiter: past this, idle clients are forgotten

Network = IPv4Network | IPv6Network


class TokenBuckets:
    """One token bucket per client: `rate` tokens a second, at most `burst` saved up; a
    request takes one. Clients whose bucket is full again are forgotten when the table
    grows past MAX_CLIENTS, so memory stays bounded under a flood of addresses."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = float(burst)
        self._state: dict[str, tuple[float, float]] = {}  # client -> (tokens, at)

    def take(self, client: str, now: float) -> float:
        """0.0 when a token was taken, else the seconds until one will be there."""
        if self.rate <= 0:
            return 0.0
        tokens, at = self._state.get(client, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        if tokens >= 1.0:
            if len(self._state) >= MAX_CLIENTS and client not in self._state:
                self._forget_idle(now)
            self._state[client] = (tokens - 1.0, now)
            return 0.0
        self._state[client] = (tokens, now)
        return (1.0 - tokens) / self.rate

    def _forget_idle(self, now: float) -> None:
        full = [c for c, (t, at) in self._state.items() if t + (now - at) * self.rate >= self.burst]
        for c in full:
            del self._state[c]
        if len(self._state) >= MAX_CLIENTS:  # everyone is busy: start over rather than grow
            self._state.clear()

    def __len__(self) -> int:
        return len(self._state)


class LiveCounts:
    """Concurrent live connections (long-poll, SSE) per client, up to `cap` (0: no cap)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._counts: dict[str, int] = {}

    def acquire(self, client: str) -> bool:
        n = self._counts.get(client, 0)
        if self.cap and n >= self.cap:
            return False
        self._counts[client] = n + 1
        return True

    def release(self, client: str) -> None:
        n = self._counts.get(client, 0) - 1
        if n > 0:
            self._counts[client] = n
        else:
            self._counts.pop(client, None)

    def count(self, client: str) -> int:
        return self._counts.get(client, 0)


def parse_networks(cidrs: Sequence[str]) -> tuple[Network, ...]:
    return tuple(ip_network(c, strict=False) for c in cidrs)


@functools.lru_cache(maxsize=4096)  # every write parses its peer: the same few addresses
def _addr(text: str) -> IPv4Address | IPv6Address | None:
    try:
        return ip_address(text.strip())
    except ValueError:
        return None


def _trusted(addr: IPv4Address | IPv6Address | None, trusted: Sequence[Network]) -> bool:
    return addr is not None and any(addr in n for n in trusted)


def client_address(peer: str | None, forwarded_for: str | None, trusted: Sequence[Network]) -> str | None:
    """The client's IP address. X-Forwarded-For counts only when the peer is a trusted proxy;
    then the client is the right-most address that is not itself a trusted proxy (the
    entries left of it were written by the client and could be anything). None for a
    trusted proxy's own request (no X-Forwarded-For): a reader's shared upstream
    subscriptions, or a local client, which is not limited."""
    here = peer or "unknown"
    if not _trusted(_addr(here), trusted):
        return here
    if not forwarded_for:
        return None
    for hop in reversed(forwarded_for.split(",")):
        addr = _addr(hop)
        if addr is None:
            return here  # garbage from a hop we trust less than the peer: use the peer
        here = str(addr)
        if not _trusted(addr, trusted):
            return here
    return here


def client_identity(subject: str | None, address: str | None) -> str | None:
    """Limits count per token subject when there is one, else per address; None: unlimited."""
    if subject:
        return subject
    return None if address is None else f"ip:{address}"
