#!/usr/bin/env bash
# Issue 27: powersgd@auto alone on the tta-wan-mnist1d definition (2 emulated nodes x 2 ranks, 100 Mbit/s, 40 and 80 ms round trips, seed 0), rerun after auto's start-up got cheaper; dense and bf16 are in experiments/tta-wan-mnist1d.sh's report.
# Needs root, iproute2 and vde2 (scripts/install-wan.sh). About 8 minutes on a 2-core machine; resumable. Run from any folder: bash experiments/tta-wan-mnist1d-auto.sh [extra options]
exec gradwire experiment --task mnist1d --nodes 2 --ranks-per-node 2 --links 100mbit --rtt 40ms,80ms --seeds 0 --methods powersgd:rank=4@auto --steps 500 --eval-every 50 --out experiment-results/tta-wan-mnist1d-auto "$@"
