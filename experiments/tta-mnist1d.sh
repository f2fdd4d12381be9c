#!/usr/bin/env bash
# Time to accuracy on 2 emulated nodes x 2 ranks, mnist1d CNN: 20 Mbit/s, 100 Mbit/s (3 seeds), 1 Gbit/s between nodes; needs root, ip and tc (docs/benchmarks.md "Time to accuracy").
# About an hour on a 2-core machine; resumable (rerun the same command). Run from any folder: bash experiments/tta-mnist1d.sh [extra options]
exec gradwire experiment --task mnist1d --nodes 2 --ranks-per-node 2 --links 20mbit,100mbit,1gbit --link-seeds 100mbit=0,1,2 --methods none,bf16,topk,topk@hierarchical,powersgd:rank=4@hierarchical,powersgd:rank=4@auto --ratios 0.01 --steps 2000 --eval-every 50 --out experiment-results/tta-mnist1d "$@"
