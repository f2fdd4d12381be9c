"""What a link between emulated nodes is: a rate, and optionally a round-trip time, jitter and loss.

A link is written as one string so that it names runs, report rows and plots unchanged:
``100mbit`` (rate only: the kernel's `tbf`, no added delay) or
``100mbit-rtt40ms[-jitter4ms][-loss0.1%]`` (a user-space wire adds the delay: wan.py).
Presets name the networks users train across (`--network internet`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NUM = r"(\d+(?:\.\d+)?)"
RATE_RE = re.compile(rf"^{_NUM}(k|m|g)bit$")
LINK_RE = re.compile(rf"^{_NUM}(k|m|g)bit(?:-rtt{_NUM}ms(?:-jitter{_NUM}ms)?(?:-loss{_NUM}%)?)?$")
_SCALE = {"k": 1e3, "m": 1e6, "g": 1e9}


@dataclass(frozen=True)
class Network:
    """One inter-node link: `rate` ("100mbit"), round-trip time between two nodes, its jitter
    (each one-way delay varies uniformly within +-jitter/2) and the end-to-end packet loss."""

    rate: str
    rtt_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0

    def __post_init__(self) -> None:
        rate_bits(self.rate)
        if self.rtt_ms < 0 or self.jitter_ms < 0 or not 0 <= self.loss_pct < 100:
            raise ValueError(f"rtt and jitter must be >= 0 ms and loss in [0, 100) %, got {self}")
        if self.jitter_ms > self.rtt_ms:
            raise ValueError(f"jitter ({self.jitter_ms:g} ms) cannot exceed the round-trip time ({self.rtt_ms:g} ms)")
        if (self.jitter_ms or self.loss_pct) and not self.rtt_ms:
            raise ValueError("jitter and loss need a round-trip time (rtt > 0): they are the delayed wire's")

    @property
    def bits(self) -> float:
        return rate_bits(self.rate)

    @property
    def delayed(self) -> bool:
        """Whether the link needs the user-space wire (wan.py) rather than tbf alone."""
        return self.rtt_ms > 0

    @property
    def label(self) -> str:
        if not self.delayed:
            return self.rate
        out = f"{self.rate}-rtt{self.rtt_ms:g}ms"
        if self.jitter_ms:
            out += f"-jitter{self.jitter_ms:g}ms"
        if self.loss_pct:
            out += f"-loss{self.loss_pct:g}%"
        return out

    def bdp_bytes(self) -> int:
        """The bandwidth-delay product: the bytes a single stream must keep in flight to fill the link."""
        return int(self.bits / 8 * self.rtt_ms / 1e3)


def rate_bits(rate: str) -> float:
    """'100mbit' -> 1e8 bits per second; a link with a round-trip time gives its rate's; else ValueError."""
    m = LINK_RE.match(rate.lower())
    if not m:
        raise ValueError(f"link {rate!r} is not of the form <number>kbit|mbit|gbit, e.g. 100mbit, "
                         "optionally followed by -rtt<ms>ms[-jitter<ms>ms][-loss<percent>%], e.g. 100mbit-rtt40ms")
    return float(m.group(1)) * _SCALE[m.group(2)]


def parse_link(link: str) -> Network:
    """'100mbit-rtt40ms-jitter4ms-loss0.1%' -> Network; bad input raises ValueError saying the form."""
    rate_bits(link)
    m = LINK_RE.match(link.lower())
    assert m is not None
    rtt, jitter, loss = (float(g) if g else 0.0 for g in m.group(3, 4, 5))
    return Network(f"{m.group(1)}{m.group(2)}bit", rtt, jitter, loss)


def link_sort_key(link: str) -> tuple[float, float]:
    """Order links by rate, then round-trip time ('none', loopback, first)."""
    if link == "none":
        return (0.0, 0.0)
    net = parse_link(link)
    return (net.bits, net.rtt_ms)


def parse_ms(text: str) -> float:
    """'40ms' or '40' -> 40.0 (milliseconds)."""
    m = re.fullmatch(rf"{_NUM}(?:ms)?", text.strip().lower())
    if not m:
        raise ValueError(f"expected a time in milliseconds such as 40ms, got {text!r}")
    return float(m.group(1))


#: Networks users train across, as this machine can emulate them honestly (docs/benchmarks.md has
#: the CPU the delayed wire costs per Gbit/s): rate between nodes and round-trip time.
PRESETS: dict[str, Network] = {
    "datacenter": Network("1gbit"),                    # one cluster: no delay worth emulating
    "region": Network("1gbit", rtt_ms=5.0),            # datacenters of one region: 1-5 ms
    "internet": Network("100mbit", rtt_ms=40.0),       # across a continent, commodity links
    "intercontinental": Network("100mbit", rtt_ms=80.0),  # e.g. New York-London, US west-east
}
