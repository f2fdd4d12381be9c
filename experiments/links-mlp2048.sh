#!/usr/bin/env bash
# Step time under emulated 100 Mbit/s and 1 Gbit/s links, 4.3M-param MLP, 4 ranks; needs root, ip and tc (docs/benchmarks.md; docs/experiments/links-mlp2048).
# Run from any folder: bash experiments/links-mlp2048.sh [extra gradwire experiment options]
exec gradwire experiment --arch mlp --width 2048 --methods none,topk,powersgd:rank=2 --ratios 0.01 --worlds 4 --links 100mbit,1gbit --steps 40 --eval-every 40 --out experiment-results/links-mlp2048 "$@"
