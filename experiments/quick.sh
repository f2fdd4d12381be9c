#!/usr/bin/env bash
# The quick experiment (README's first command; docs/benchmarks.md "Quick experiment").
# Run from any folder: bash experiments/quick.sh [extra gradwire experiment options]
exec gradwire experiment --quick "$@"
