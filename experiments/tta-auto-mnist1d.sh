#!/usr/bin/env bash
# auto against dense and bf16 on the mnist1d CNN, 2 emulated nodes x 2 ranks, 100 Mbit/s and 1 Gbit/s between nodes, seeds 0, 1, 2 (docs/benchmarks.md "auto, rechecked"); needs root, ip and tc.
# About 25 minutes on a 2-core machine; resumable (rerun the same command). Run from any folder: bash experiments/tta-auto-mnist1d.sh [extra options]
exec gradwire experiment --task mnist1d --nodes 2 --ranks-per-node 2 --links 100mbit,1gbit --seeds 0,1,2 --methods none,bf16,powersgd:rank=4@auto --steps 2000 --eval-every 50 --out experiment-results/tta-auto-mnist1d "$@"
