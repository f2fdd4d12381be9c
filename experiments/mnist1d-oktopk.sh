#!/usr/bin/env bash
# oktopk (O(k) sparse allreduce) beside allgather top-k and dense, mnist1d CNN, 4 ranks; its report's
# projection carries the measured bytes to 1024 ranks (docs/benchmarks.md; docs/experiments/mnist1d-oktopk).
# Run from any folder: bash experiments/mnist1d-oktopk.sh [extra gradwire experiment options]
exec gradwire experiment --methods none,topk,topk@oktopk --ratios 0.01 --worlds 4 --steps 1500 --eval-every 250 --out experiment-results/mnist1d-oktopk "$@"
