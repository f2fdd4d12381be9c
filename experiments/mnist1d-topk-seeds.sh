#!/usr/bin/env bash
# Top-k 1% + EF vs dense, mnist1d CNN, 4 ranks, 3 seeds (docs/benchmarks.md; docs/experiments/mnist1d-topk-seeds).
# Run from any folder: bash experiments/mnist1d-topk-seeds.sh [extra gradwire experiment options]
exec gradwire experiment --methods none,topk --ratios 0.01 --worlds 4 --steps 2000 --eval-every 250 --seeds 0,1,2 --out experiment-results/mnist1d-topk-seeds "$@"
