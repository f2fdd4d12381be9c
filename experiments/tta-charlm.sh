#!/usr/bin/env bash
# Time to perplexity on 2 emulated nodes x 2 ranks, charlm transformer (0.47M params, 2 x 64 bytes per rank per step, so that a dense step is communication-bound at 100 Mbit/s): 20 Mbit/s, 100 Mbit/s (3 seeds), 1 Gbit/s between nodes; needs root, ip and tc (docs/benchmarks.md "Time to accuracy").
# About 50 minutes on a 2-core machine; resumable (rerun the same command). Run from any folder: bash experiments/tta-charlm.sh [extra options]
exec gradwire experiment --task charlm --batch 2 --nodes 2 --ranks-per-node 2 --links 20mbit,100mbit,1gbit --link-seeds 100mbit=0,1,2 --methods none,bf16,topk,topk@hierarchical,powersgd:rank=8@hierarchical,powersgd:rank=8@auto --ratios 0.01 --steps 600 --eval-every 25 --out experiment-results/tta-charlm "$@"
