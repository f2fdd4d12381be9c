#!/usr/bin/env bash
# Character-level transformer LM trained until dense's test perplexity bottoms out: 2 ranks x 3,200
# steps and 4 ranks x 1,600 steps (both ~15.6 epochs of the text); dense, top-k 1% + EF and PowerSGD rank 16 with
# charlm's LM settings (docs/benchmarks.md, "charlm to convergence"; docs/experiments/charlm-convergence-*).
# Run from any folder: bash experiments/charlm-convergence.sh [extra gradwire experiment options]
set -e
gradwire experiment --task charlm --methods none,topk,powersgd:rank=16 --ratios 0.01 --worlds 2 --steps 3200 --eval-every 400 --out experiment-results/charlm-convergence-2rank "$@"
gradwire experiment --task charlm --methods none,topk,powersgd:rank=16 --ratios 0.01 --worlds 4 --steps 1600 --eval-every 200 --out experiment-results/charlm-convergence-4rank "$@"
