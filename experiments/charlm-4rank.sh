#!/usr/bin/env bash
# Character-level transformer LM, 4 ranks, 400 steps (docs/benchmarks.md; docs/experiments/charlm-4rank).
# charlm's tuned settings apply by default: top-k with Adam before the exchange and a 100-step density
# warm-up, PowerSGD after 40 dense steps (docs/experiments.md, "LM settings").
# Run from any folder: bash experiments/charlm-4rank.sh [extra gradwire experiment options]
exec gradwire experiment --task charlm --methods none,topk,powersgd:rank=16,powersgd:rank=32 --ratios 0.01 --worlds 4 --steps 400 --eval-every 100 --out experiment-results/charlm-4rank "$@"
