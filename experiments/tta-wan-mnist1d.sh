#!/usr/bin/env bash
# Time to accuracy across a WAN: the mnist1d CNN on 2 emulated nodes x 2 ranks, 100 Mbit/s and 40 or 80 ms round trips between nodes (issue 27; docs/benchmarks.md "Round-trip time"). Methods: dense, bf16, PowerSGD between nodes, the O(k) sparse allreduce, powersgd@auto; seed 0.
# Needs root, iproute2 and vde2 (scripts/install-wan.sh). About 45 minutes on a 2-core machine; resumable (rerun the same command). Run from any folder: bash experiments/tta-wan-mnist1d.sh [extra options]
exec gradwire experiment --task mnist1d --nodes 2 --ranks-per-node 2 --links 100mbit --rtt 40ms,80ms --seeds 0 --methods none,bf16,powersgd:rank=4@hierarchical,topk:ratio=0.01@oktopk,powersgd:rank=4@auto --steps 500 --eval-every 50 --out experiment-results/tta-wan-mnist1d "$@"
