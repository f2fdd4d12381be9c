"""An emulated bandwidth-limited cluster: one network namespace per node on a shared bridge.

Layout: a "switch" namespace holds a Linux bridge; each node's namespace holds one end of a
veth pair (its only interface besides loopback) and the other end is a bridge port. Both
directions of every link are shaped by a `tbf` qdisc (the node's upload on its own veth end,
its download on the bridge port), so each node has a full-duplex link of the given rate into
a non-blocking switch, like hosts on one top-of-rack switch. The `ranks_per_node` ranks of a
node share its namespace and address: traffic between them never leaves the node (unshaped,
as over NVLink or shared memory), while everything they send to other nodes shares the node's
one shaped link, as a real node's NIC. Addresses are created for the run
in 10.213.N.0/24 and reach nothing else. `teardown()` deletes every namespace it made (which
removes the veths and the bridge); it runs on normal exit, exceptions, Ctrl-C and SIGTERM,
and namespaces left by a process that died are removed the next time a cluster is built.

A link with a round-trip time (``100mbit-rtt40ms``, network.py) replaces the veths, bridge and
tbf with user-space wires that delay, rate-limit and drop (wan.py): the same namespaces and
addresses, each node's interface a TAP device.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from types import FrameType, TracebackType

from .network import LINK_RE, RATE_RE, Network, parse_link, rate_bits
from .wan import Wires, missing_tools, tcp_buffer_bytes

PREFIX = "gwx"
__all__ = ["EmulatedCluster", "EmulationUnavailable", "LINK_RE", "RATE_RE", "check_available", "rate_bits"]


class EmulationUnavailable(RuntimeError):
    """The emulated cluster cannot be built here (privileges or tools missing)."""


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")


def _mac(ns: str, dev: str) -> str:
    out = subprocess.run(["ip", "-n", ns, "-o", "link", "show", dev], capture_output=True, text=True).stdout
    found = re.search(r"link/ether ([0-9a-f:]{17})", out)
    if found is None:
        raise RuntimeError(f"no MAC address for {dev} in {ns}: {out.strip()!r}")
    return found.group(1)


def check_available(delayed: bool = False) -> None:
    """Raise EmulationUnavailable with what is missing (for links with a round-trip time too,
    when `delayed`); does nothing when all is in place."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise EmulationUnavailable(f"the emulated cluster needs iproute2's {' and '.join(missing)} on PATH")
    if os.geteuid() != 0:
        raise EmulationUnavailable("the emulated cluster needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create "
                                   "network namespaces and tbf qdiscs")
    if delayed:
        if missing_tools():
            raise EmulationUnavailable(f"a round-trip time between emulated nodes needs vde2's "
                                       f"{' and '.join(missing_tools())} on PATH (apt-get install vde2)")
        if not os.path.exists("/dev/net/tun"):
            raise EmulationUnavailable("a round-trip time between emulated nodes needs TAP devices: /dev/net/tun "
                                       "is missing (modprobe tun, or run the container with --device /dev/net/tun)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete namespaces (and delayed wires' socket folders) left by cluster owners that no longer
    run; returns their names."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    removed = []
    for line in out.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.match(rf"^{PREFIX}(\d+)(sw|r\d+)$", name)
        if m and not _alive(int(m.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(name)
    for folder in Path(tempfile.gettempdir()).glob("gradwire-wan-*-*"):  # a killed owner's wire sockets
        m = re.match(r"^gradwire-wan-(\d+)-", folder.name)
        if m and not _alive(int(m.group(1))):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder.name)
    return removed


class EmulatedCluster:
    """Context manager: `with EmulatedCluster(4, "100mbit") as c: c.prefix(r) + [python, ...]`."""

    def __init__(self, world: int, rate: str, latency_ms: float = 100.0, ranks_per_node: int = 1) -> None:
        """`rate`: a link as network.py spells it ("100mbit", "100mbit-rtt40ms"); `latency_ms`:
        how long tbf may queue a packet (links without a round-trip time)."""
        if world < 1 or world > 250:
            raise ValueError(f"emulated cluster size must be 1..250 ranks, got {world}")
        if ranks_per_node < 1 or world % ranks_per_node:
            raise ValueError(f"{world} ranks do not split into nodes of {ranks_per_node}")
        self.world = world
        self.ranks_per_node = ranks_per_node
        self.nodes = world // ranks_per_node
        self.net: Network = parse_link(rate)
        self.rate = self.net.rate
        self.bits = self.net.bits
        self.wires: Wires | None = None
        self.latency_ms = latency_ms
        self.owner = os.getpid()
        self.subnet = f"10.213.{self.owner % 250}"
        self.namespaces: list[str] = []
        self._old_handler: signal.Handlers | None = None

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def ns(self, rank: int) -> str:
        return f"{PREFIX}{self.owner}r{self.node(rank)}"

    def address(self, rank: int) -> str:
        return f"{self.subnet}.{self.node(rank) + 1}"

    def iface(self, rank: int) -> str:
        return f"{PREFIX}{self.node(rank)}{'t' if self.net.delayed else 'a'}"

    def prefix(self, rank: int) -> list[str]:
        """Command prefix that runs a program inside rank's namespace."""
        return ["ip", "netns", "exec", self.ns(rank)]

    def _shape(self, ns: str, dev: str) -> None:
        # the bucket must hold a whole GSO segment (up to 64 KiB) or tbf drops it; at least 4 ms of data
        burst = max(int(self.bits / 8 * 0.004), 131072)
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
             "burst", str(burst), "latency", f"{self.latency_ms:g}ms")

    def build(self) -> None:
        check_available(self.net.delayed)
        remove_stale()
        if self.net.delayed:
            self._build_delayed()
            return
        switch = f"{PREFIX}{self.owner}sw"
        try:
            _run("ip", "netns", "add", switch)
        except RuntimeError as exc:
            raise EmulationUnavailable(f"cannot create network namespaces here: {exc}") from exc
        self.namespaces.append(switch)
        _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", switch, "link", "set", "br0", "up")
        for node in range(self.nodes):
            r = node * self.ranks_per_node  # the node's first rank names it
            ns, inner, outer = self.ns(r), self.iface(r), f"p{node}"
            _run("ip", "netns", "add", ns)
            self.namespaces.append(ns)
            _run("ip", "link", "add", inner, "netns", ns, "type", "veth", "peer", "name", outer, "netns", switch)
            _run("ip", "-n", ns, "addr", "add", f"{self.address(r)}/24", "dev", inner)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "link", "set", inner, "up")
            _run("ip", "-n", switch, "link", "set", outer, "master", "br0")
            _run("ip", "-n", switch, "link", "set", outer, "up")
            self._shape(ns, inner)       # upload
            self._shape(switch, outer)   # download

    def _build_delayed(self) -> None:
        """Namespaces joined by vde2 wires (wan.py), their TCP tuned as hosts on a long fat link are:
        socket buffers up to several bandwidth-delay products, and no return to slow start after
        an idle gap (a training step's exchange follows its compute; restarting from a 10-packet
        window each step would cost several round trips that a tuned host does not pay)."""
        self.wires = Wires(self.net, self.owner)
        most = tcp_buffer_bytes(self.net)
        switches = []
        for node in range(self.nodes):
            r = node * self.ranks_per_node
            ns, tap = self.ns(r), self.iface(r)
            try:
                _run("ip", "netns", "add", ns)
            except RuntimeError as exc:
                raise EmulationUnavailable(f"cannot create network namespaces here: {exc}") from exc
            self.namespaces.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            try:
                switches.append(self.wires.switch(f"node{node}", ns, tap))
            except RuntimeError as exc:
                raise EmulationUnavailable(f"cannot build the delayed links: {exc}") from exc
            _run("ip", "-n", ns, "addr", "add", f"{self.address(r)}/24", "dev", tap)
            _run("ip", "-n", ns, "link", "set", tap, "up")
            _run("ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.tcp_rmem=4096 131072 {most}",
                 f"net.ipv4.tcp_wmem=4096 16384 {most}", "net.ipv4.tcp_slow_start_after_idle=0")
        try:
            self.wires.connect(switches)
        except RuntimeError as exc:
            raise EmulationUnavailable(f"cannot build the delayed links: {exc}") from exc
        self._pin_neighbours()

    def _pin_neighbours(self) -> None:
        """Permanent ARP entries between every pair of nodes. The loss a WAN link emulates happens
        between routers, where no ARP crosses; letting the wires drop ARP would instead stall a
        node for the 1-3 s of ARP retries (unicast packets queued meanwhile) whenever an address
        is first used or re-probed, a stall no routed path shows."""
        firsts = [node * self.ranks_per_node for node in range(self.nodes)]
        macs = {r: _mac(self.ns(r), self.iface(r)) for r in firsts}
        for r in firsts:
            for peer in firsts:
                if peer != r:
                    _run("ip", "-n", self.ns(r), "neigh", "replace", self.address(peer), "lladdr", macs[peer],
                         "dev", self.iface(r), "nud", "permanent")

    def teardown(self) -> None:
        if self.wires is not None:
            self.wires.stop()
            self.wires = None
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()

    def __enter__(self) -> "EmulatedCluster":
        self._old_handler = signal.getsignal(signal.SIGTERM)  # type: ignore[assignment]
        signal.signal(signal.SIGTERM, _raise_exit)
        try:
            self.build()
        except BaseException:
            self.teardown()
            signal.signal(signal.SIGTERM, self._old_handler)
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.teardown()
        signal.signal(signal.SIGTERM, self._old_handler)


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through __exit__, so the namespaces go
