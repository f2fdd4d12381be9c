#!/usr/bin/env bash
# Character-level transformer LM, 2 ranks x 3,200 steps (~15.6 epochs of the text, until dense's test perplexity
# bottoms out): dense, top-k 1% + EF and PowerSGD rank 16 with charlm's LM settings (docs/benchmarks.md,
# "charlm to convergence"; docs/experiments/charlm-convergence-2rank). 4 ranks: charlm-convergence-4rank.sh.
# Run from any folder: bash experiments/charlm-convergence-2rank.sh [extra gradwire experiment options]
exec gradwire experiment --task charlm --methods none,topk,powersgd:rank=16 --ratios 0.01 --worlds 2 --steps 3200 --eval-every 400 --out experiment-results/charlm-convergence-2rank "$@"
