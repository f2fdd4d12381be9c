"""Check the emulated cluster's delayed links (gradwire/experiments/wan.py) against what they claim.

For each link: the round-trip time `ping` sees between two nodes (20 pings after one that
resolves the address) beside the one set; the goodput of one TCP stream (`iperf3`, 10 s) and
of gloo's own exchange (an allreduce between one rank per node, about 5 s of data at the link's
rate at most, over one connection and striped over 4: TorchDistBackend(stripes=4)); and the CPU
the emulator's processes (vde_switch, wirefilter) burned meanwhile, per Gbit/s carried, which
says up to which rate this machine emulates a link honestly. Needs root, vde2, ping and iperf3
(scripts/install-wan.sh). Prints a markdown table; docs/benchmarks.md records one.

    python benchmarks/wan_links.py                      # the table in docs/benchmarks.md
    python benchmarks/wan_links.py --quick              # 3 s per measurement
    python benchmarks/wan_links.py --auto               # what auto's probe measures on 2 nodes x 2 ranks
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gradwire.experiments.cluster import EmulatedCluster
from gradwire.experiments.network import parse_link

RANK = """
import sys, time, torch, torch.distributed as dist
from gradwire.comm.torch_dist import TorchDistBackend
rank, addr, nbytes = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://{addr}:29533", rank=rank, world_size=2)
t = torch.zeros(nbytes // 4)
for stripes in (1, 4):
    backend = TorchDistBackend(stripes=stripes)
    backend.allreduce(t[: 1 << 18]).wait()  # (opens the stripes' connections)
    dist.barrier()
    began = time.perf_counter()
    backend.allreduce(t).wait()
    took = time.perf_counter() - began
    if rank == 0:
        print(f"stripes {stripes} took {took:.6f}", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes have used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / tick


def ping_ms(c: EmulatedCluster, count: int) -> list[float]:
    run = lambda n: subprocess.run(c.prefix(0) + ["ping", "-c", str(n), "-i", "0.05", "-q" if n == 1 else "-n",
                                                  c.address(1)], capture_output=True, text=True, check=True).stdout
    run(1)  # (resolves the address: the first ping also waits for ARP)
    return [float(m) for m in re.findall(r"time=([\d.]+) ms", run(count))]


def iperf_mbit(c: EmulatedCluster, seconds: float) -> float:
    server = subprocess.Popen(c.prefix(1) + ["iperf3", "-s", "-1", "-p", "5299"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        out = subprocess.run(c.prefix(0) + ["iperf3", "-c", c.address(1), "-p", "5299", "-t", f"{seconds:g}", "-f", "m"],
                             capture_output=True, text=True, check=True).stdout
    finally:
        server.wait(timeout=30)
    return float(re.findall(r"([\d.]+) Mbits/sec.*receiver", out)[-1])


def gloo_mbit(c: EmulatedCluster, nbytes: int) -> dict[int, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(c.prefix(r) + [sys.executable, "-c", RANK, str(r), c.address(0), str(nbytes)],
                              env=dict(env, GLOO_SOCKET_IFNAME=c.iface(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for r in range(2)]
    out = [p.communicate(timeout=300)[0] for p in procs]
    took = {int(k): float(t) for k, t in re.findall(r"stripes (\d+) took ([\d.]+)", out[0])}
    return {k: nbytes * 8 / t / 1e6 for k, t in took.items()}  # a 2-rank allreduce moves nbytes each way


AUTO = """
import json, sys, torch.distributed as dist
from gradwire.comm.torch_dist import TorchDistBackend
from gradwire.comm.auto import Auto
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"tcp://{sys.argv[2]}:29547", rank=rank, world_size=4)
auto = Auto(TorchDistBackend(), "topk:ratio=0.01", ranks_per_node=2, trials=0)
if rank == 0:
    print(json.dumps({level: [m.alpha, m.beta] for level, m in
                      (("flat", auto.model), ("intra", auto.intra_model), ("inter", auto.inter_model))}), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def auto_probe(link: str) -> dict[str, list[float]]:
    """auto's alpha (s per round) and beta (s per byte) per level, on 2 nodes x 2 ranks."""
    with EmulatedCluster(4, link, ranks_per_node=2) as c:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"}
        procs = [subprocess.Popen(c.prefix(r) + [sys.executable, "-c", AUTO, str(r), c.address(0)],
                                  env=dict(env, GLOO_SOCKET_IFNAME=c.iface(r)), stdout=subprocess.PIPE, text=True)
                 for r in range(4)]
        outs = [p.communicate(timeout=300)[0] for p in procs]
    return json.loads(outs[0].strip().splitlines()[-1])


def measure(link: str, seconds: float, pings: int) -> dict:
    net = parse_link(link)
    with EmulatedCluster(2, link) as c:
        assert c.wires is not None
        pids = [p.pid for p in c.wires.procs]
        rtts = ping_ms(c, pings)
        cpu0, t0 = cpu_seconds(pids), time.monotonic()
        tcp = iperf_mbit(c, seconds)
        cores_tcp = (cpu_seconds(pids) - cpu0) / (time.monotonic() - t0)
        gloo = gloo_mbit(c, int(net.bits / 8 * seconds * 0.5))
    return {"link": link, "set_ms": net.rtt_ms, "ping_ms": statistics.median(rtts), "ping_min": min(rtts),
            "ping_max": max(rtts), "tcp_mbit": tcp, "gloo_mbit": gloo, "rate_mbit": net.bits / 1e6,
            "cores": cores_tcp, "cores_per_gbit": cores_tcp / (tcp / 1e3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--links", default="100mbit-rtt20ms,100mbit-rtt40ms,100mbit-rtt80ms,1gbit-rtt40ms")
    p.add_argument("--quick", action="store_true", help="3 s per goodput measurement, 10 pings")
    p.add_argument("--auto", action="store_true", help="instead: auto's link probe on 2 nodes x 2 ranks per link")
    args = p.parse_args(argv)
    if args.auto:
        print("| link | level | alpha (ms per round) | 1/beta (Mbit/s) |")
        print("|---|---|---|---|")
        for link in args.links.split(","):
            for level, (alpha, beta) in auto_probe(link.strip()).items():
                print(f"| {link} | {level} | {alpha * 1e3:.3f} | {8e-6 / beta:.0f} |", flush=True)
        return 0
    seconds, pings = (3.0, 10) if args.quick else (10.0, 20)
    print("| link | RTT set | ping median (min-max) | within 10% | TCP, 1 stream | gloo allreduce, 2 ranks "
          "| the same over 4 stripes | emulator CPU (cores) | cores per Gbit/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for link in args.links.split(","):
        r = measure(link.strip(), seconds, pings)
        ok = abs(r["ping_ms"] - r["set_ms"]) <= 0.1 * r["set_ms"]
        print(f"| {r['link']} | {r['set_ms']:g} ms | {r['ping_ms']:.1f} ms ({r['ping_min']:.1f}-{r['ping_max']:.1f}) "
              f"| {'yes' if ok else 'NO'} | {r['tcp_mbit']:.0f} Mbit/s ({r['tcp_mbit'] / r['rate_mbit']:.0%}) "
              + "".join(f"| {r['gloo_mbit'][k]:.0f} Mbit/s ({r['gloo_mbit'][k] / r['rate_mbit']:.0%}) " for k in (1, 4))
              + f"| {r['cores']:.2f} "
              f"| {r['cores_per_gbit']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
