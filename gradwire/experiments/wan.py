"""Delayed links between emulated nodes, from vde2's user-space parts (this kernel has no `netem`).

Each node's namespace gets a TAP device that a `vde_switch` (run inside that namespace) owns;
`wirefilter` processes join the switches and delay, rate-limit and drop packets per direction.
Two nodes: one wire between their switches, delay rtt/2 each way. More nodes: a hub switch and
one wire per node, delay rtt/4 each way, so every pair of nodes sees the round-trip time set
and each node's link carries the rate in both directions, as a NIC into a switch. Each wire
queues at most one bandwidth-delay product (at least 64 KiB) and drops beyond it, as a router's
buffer. The processes hold a pipe from their owner as stdin: if the owner dies without tearing
down, they read EOF and exit, so nothing outlives a killed run. Traffic between ranks of one node
stays inside its namespace and is not delayed.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from .network import Network

TOOLS = ("vde_switch", "wirefilter")
MIN_QUEUE = 64 * 1024


def missing_tools() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]


def wire_args(net: Network, hops: int) -> list[str]:
    """wirefilter options for one of `hops` wires in series on a path between two nodes."""
    delay = net.rtt_ms / (2 * hops)
    args = ["-d", f"{delay:g}+{net.jitter_ms / (2 * hops):g}U" if net.jitter_ms else f"{delay:g}"]
    args += ["-b", str(int(net.bits / 8))]
    args += ["-c", str(max(net.bdp_bytes(), MIN_QUEUE))]
    if net.loss_pct:
        per_wire = 100 * (1 - (1 - net.loss_pct / 100) ** (1 / hops))  # end-to-end loss as set
        args += ["-l", f"{per_wire:.6g}"]
    return args


def tcp_buffer_bytes(net: Network) -> int:
    """The most a socket may buffer: four bandwidth-delay products (at least 4 MiB), so one TCP
    stream can fill the link (the kernel's default ceiling, 6 MiB, is one BDP at 1 Gbit/s x 48 ms)."""
    return max(4 * net.bdp_bytes(), 4 << 20)


class Wires:
    """The vde switches and wires of one emulated cluster: a `switch` per node, then `connect`."""

    def __init__(self, net: Network, owner: int) -> None:
        self.net = net
        self.dir = Path(tempfile.mkdtemp(prefix=f"gradwire-wan-{owner}-"))
        self.procs: list[subprocess.Popen] = []

    def _spawn(self, cmd: list[str]) -> subprocess.Popen:
        log = open(self.dir / f"{len(self.procs)}.log", "w")
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.procs.append(proc)
        return proc

    def _wait_for(self, path: Path, proc: subprocess.Popen, what: str) -> None:
        deadline = time.monotonic() + 10
        while not path.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                log = (self.dir / f"{self.procs.index(proc)}.log").read_text(errors="replace").strip()
                raise RuntimeError(f"{what} did not start: {log or f'exit code {proc.poll()}'}")
            time.sleep(0.02)

    def switch(self, name: str, ns: str | None = None, tap: str | None = None) -> Path:
        """A vde_switch with socket `name` (inside namespace `ns`, owning TAP device `tap` there)."""
        sock = self.dir / name
        cmd = ["vde_switch", "-s", str(sock)] + (["-t", tap] if tap else [])
        proc = self._spawn((["ip", "netns", "exec", ns] if ns else []) + cmd)
        self._wait_for(sock / "ctl", proc, f"vde_switch {name}")
        if ns and tap:
            deadline = time.monotonic() + 10
            while subprocess.run(["ip", "-n", ns, "link", "show", tap], capture_output=True).returncode:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"vde_switch did not create TAP device {tap} in {ns} (is /dev/net/tun there?)")
                time.sleep(0.02)
        return sock

    def wire(self, a: Path, b: Path, hops: int) -> None:
        """A wirefilter between switch sockets a and b, one of `hops` wires on a node-to-node path."""
        proc = self._spawn(["wirefilter", "-v", f"{a}:{b}", *wire_args(self.net, hops)])
        time.sleep(0.05)
        if proc.poll() is not None:
            log = (self.dir / f"{self.procs.index(proc)}.log").read_text(errors="replace").strip()
            raise RuntimeError(f"wirefilter {a.name}:{b.name} exited: {log}")

    def connect(self, switches: list[Path]) -> None:
        """Join the nodes' switches: directly for two, through a hub for more."""
        if len(switches) < 2:
            return
        if len(switches) == 2:
            self.wire(switches[0], switches[1], hops=1)
            return
        hub = self.switch("hub")
        for sock in switches:
            self.wire(sock, hub, hops=2)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

