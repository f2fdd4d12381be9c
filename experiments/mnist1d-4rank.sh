#!/usr/bin/env bash
# All methods, mnist1d CNN, 4 ranks, 2,500 steps, every tensor compressed (docs/benchmarks.md; docs/experiments/mnist1d-4rank).
# Run from any folder: bash experiments/mnist1d-4rank.sh [extra gradwire experiment options]
exec gradwire experiment --methods none,topk,randomk:ratio=0.1,qsgd:bits=4,powersgd:rank=2 --ratios 0.01,0.1 --worlds 4 --steps 2500 --eval-every 250 --seeds 0 --min-numel 0 --out experiment-results/mnist1d-4rank "$@"
