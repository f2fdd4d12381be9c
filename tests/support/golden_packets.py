"""The packets every compressor sent at release 0.1.0, pinned as SHA-256 digests.

`python tests/support/golden_packets.py` rewrites tests/compress/golden_packets.json; run it only
when the wire format changes on purpose (with a new format version). The test in
tests/compress/test_golden_packets.py re-encodes the same inputs and compares.
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import torch

from gradwire.compress import Ctx, DGCMomentum, ErrorFeedback, compressor

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "compress" / "golden_packets.json"

SPECS = [
    "none", "fp16", "bf16", "fp8", "fp8:format=e5m2,chunk=256", "int8", "int8:chunk=100",
    "qsgd", "qsgd:bits=4", "qsgd:bits=2,bucket=128", "terngrad", "terngrad:bucket=64",
    "sign", "onebit", "onebit:chunk=300",
    "topk:ratio=0.01", "topk:k=37,indices=packed", "topk:ratio=0.05,indices=raw",
    "randomk:ratio=0.01", "randomk:k=50", "threshold:threshold=1.5", "threshold:threshold=2,indices=packed",
    "dgc:ratio=0.01", "dgc:ratio=0.02,indices=packed",
    "zstd", "fp16+zstd", "topk:ratio=0.01+qsgd:bits=4", "topk:ratio=0.01+fp16+zstd",
    "randomk:ratio=0.02+int8", "threshold:threshold=1.5+sign", "dgc:ratio=0.01+fp8+zstd:level=3",
    "fp4", "fp4:chunk=100", "topk:ratio=0.01,chunk=1024+terngrad",
]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
NUMEL = 12_345


def gradient(step: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(NUMEL, generator=g) * torch.linspace(0.1, 3.0, NUMEL)
    return x.to(dtype)


def digest(packet) -> str:
    return hashlib.sha256(packet.tensor().numpy().tobytes()).hexdigest()


def packets() -> dict[str, str]:
    """Every case's digest: a plain encode, three steps of error feedback, and DGC momentum."""
    out: dict[str, str] = {}
    for spec in SPECS:
        for dname, dtype in DTYPES.items():
            c = compressor(spec)
            ctx = Ctx(seed=7, step=3, rank=1, key="layer.weight")
            out[f"{spec}|{dname}|plain"] = digest(c.encode(gradient(0, dtype), ctx))
            ef = ErrorFeedback(compressor(spec))
            for step in range(3):
                pk = ef.encode(gradient(step, dtype), "layer.weight", Ctx(seed=7, step=step, rank=1, key="layer.weight"))
                out[f"{spec}|{dname}|ef{step}"] = digest(pk)
            if spec.startswith(("topk", "dgc")) and "+" not in spec:
                mom = DGCMomentum(compressor(spec), momentum=0.9)
                for step in range(3):
                    pk = mom.encode(gradient(step, dtype), "w", Ctx(seed=7, step=step, rank=0, key="w"))
                    out[f"{spec}|{dname}|dgcm{step}"] = digest(pk)
    return out


if __name__ == "__main__":
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(packets(), indent=0, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
