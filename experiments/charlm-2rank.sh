#!/usr/bin/env bash
# Character-level transformer LM, 2 ranks, 400 steps (docs/benchmarks.md; docs/experiments/charlm-2rank).
# Run from any folder: bash experiments/charlm-2rank.sh [extra gradwire experiment options]
exec gradwire experiment --task charlm --methods none,topk,powersgd:rank=4 --ratios 0.01 --worlds 2 --steps 400 --eval-every 100 --min-numel 0 --out experiment-results/charlm-2rank "$@"
