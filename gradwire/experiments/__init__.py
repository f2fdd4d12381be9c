"""Accuracy-vs-bandwidth experiments: real multi-rank training with the gradwire DDP hook.

`gradwire experiment` (see `gradwire.experiments.cli`) sweeps compressors x ratios x world sizes, trains
each run on N local ranks (optionally inside an emulated, rate-limited network), records loss,
accuracy, bytes sent and time per step, and writes JSONL/CSV, plots and a markdown report.
"""
