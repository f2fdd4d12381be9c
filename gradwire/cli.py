"""The `gradwire` command: compare compressors on real gradients, benchmark them."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict

import torch

from . import bench
from .compress import available, registry
from .realgrads import model_gradients

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {path}")


def _machine() -> dict:
    return {"date": time.strftime("%Y-%m-%d"), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def cmd_compare(args: argparse.Namespace) -> int:
    grads = model_gradients(seed=args.seed, dtype=DTYPES[args.dtype])
    print(f"real gradients: built-in MLP, {grads.numel():,} {args.dtype} elements "
          f"({grads.numel() * grads.element_size() / 1e6:.2f} MB), seed {args.seed}")
    rows = [asdict(r) for r in bench.compare(grads, args.spec, args.repeat)]
    print(bench.format_table(rows, bench.ROW_COLUMNS))
    _write_json(args.json, {"machine": _machine(), "numel": grads.numel(), "dtype": args.dtype, "rows": rows})
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    out: dict = {"machine": _machine(), "command": " ".join(["gradwire"] + sys.argv[1:])}
    parts = set(args.only.split(","))
    if "throughput" in parts:
        print(f"CPU throughput, randn({args.numel:,}) float32, best of {args.repeat}, "
              f"{torch.get_num_threads()} threads (GB/s of input)")
        rows = bench.throughput(args.numel, args.spec, args.repeat)
        print(bench.format_table(rows, bench.ROW_COLUMNS[:1] + [("encode_gbps", "enc GB/s", ".3f"),
                                 ("vs_copy", "x copy", ".2f"), ("decode_gbps", "dec GB/s", ".3f"),
                                 ("ratio", "ratio", ".1f")]))
        out["throughput"] = rows
    if "wire" in parts or "lossless" in parts:
        real32 = model_gradients(seed=0)
        tensors = {"real gradients fp32": real32, "randn fp32": torch.randn(real32.numel())}
    if "wire" in parts:
        rows = bench.wire_efficiency(tensors)
        print("\nWire efficiency, top-k 1% (bytes per kept element, header included)")
        print(bench.format_table(rows, [("tensor", "tensor", "s"), ("spec", "compressor", "s"), ("kept", "kept", "d"),
                                        ("packet_bytes", "bytes", "d"), ("bytes_per_kept", "B/kept", ".3f")]))
        out["wire"] = rows
    if "lossless" in parts:
        rows = bench.lossless_ratios({"real gradients fp32": real32, "real gradients bf16": real32.bfloat16()})
        print("\nLossless on real gradients: zstd of raw bytes vs zstd on byte planes (same level)")
        print(bench.format_table(rows, [("tensor", "tensor", "s"), ("bytes", "bytes", "d"),
                                        ("zstd_raw_ratio", "raw zstd", ".3f"),
                                        ("zstd_byteplane_ratio", "byte planes", ".3f"), ("gain", "gain", ".1%")]))
        out["lossless"] = rows
    _write_json(args.json, out)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    print(f"{'name':10s} {'role':8s} {'EF auto':8s} parameters")
    for name in available():
        cls = registry.lookup(name)
        params = ", ".join(f"{p.name}={p.default}" + (f" ({p.rule})" if p.rule else "") for p in cls.params)
        print(f"{name:10s} {cls.role:8s} {'on' if cls.feedback_helps else 'off':8s} {params}")
    print("\nEF auto: error feedback under error_feedback='auto', the default of the DDP hook, GradientExchanger\n"
          "and the Horovod optimizer: on for biased compressors, off for casts and unbiased estimators, whose\n"
          "residuals only add variance; a chain is on if any stage is. PowerSGD keeps its own (on).")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gradwire", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compare", help="compare compressors on real gradients of a small built-in model")
    c.add_argument("--spec", action="append", help="compressor spec (repeatable); default: one of each")
    c.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--repeat", type=int, default=3)
    c.add_argument("--json", help="also write the results to this JSON file")
    c.set_defaults(func=cmd_compare)
    b = sub.add_parser("bench", help="CPU throughput, wire efficiency and lossless ratios")
    b.add_argument("--numel", type=int, default=25_000_000)
    b.add_argument("--spec", action="append", help="compressor spec (repeatable); default: one of each")
    b.add_argument("--repeat", type=int, default=3)
    b.add_argument("--only", default="throughput,wire,lossless", help="comma list of throughput, wire, lossless")
    b.add_argument("--json", help="also write the results to this JSON file")
    b.set_defaults(func=cmd_bench)
    sub.add_parser("experiment", add_help=False,
                   help="train real models on N ranks and plot accuracy vs bytes (gradwire experiment --help)")
    ls = sub.add_parser("list", help="list compressors and their parameters")
    ls.set_defaults(func=cmd_list)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["experiment"]:  # its own parser: gradwire/experiments/cli.py
        from .experiments.cli import main as experiment_main

        return experiment_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad specs and parameters: a clear message, not a traceback
        print(f"gradwire: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
