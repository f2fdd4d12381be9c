"""Fuzzing every decoder with mutated packets: only `WireFormatError` may escape.

For every registered compressor (so ones added later are fuzzed too) and a few chains, a
valid packet is mutated at any level of its structure -- the outer packet's bytes, the inner
packet of a zstd frame (re-framed validly, so the mutation reaches the inner decoder), or a
chain's nested value packet -- by truncation, appended bytes, bit flips, header fields set to
edge values (section lengths, numel/shape, codec, dtype, counts), or section contents
rewritten (out-of-range / unsorted / duplicate indices, non-finite floats, wrong counts,
missing, extra or re-typed sections). Decoding must then either raise
`gradwire.WireFormatError` or return a tensor of the declared shape and dtype (the input's
shape whenever the outer header is unchanged); `out=` is passed in some examples.
"""

from __future__ import annotations

import math
import os
import signal
import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradwire
from gradwire import Ctx, WireFormatError
from gradwire.compress import wire
from gradwire.compress.lossless import frame_content
from gradwire.compress.wire import DTYPE_CODES, FLOAT_DTYPES, Kind, Packet, Section

CHAINS = ["fp16+zstd", "topk:ratio=0.1+fp16", "topk:ratio=0.05+qsgd:bits=4+zstd", "randomk:ratio=0.2+int8",
          "topk:ratio=0.2+zstd"]
# non-default configs that put other sections on the wire (raw vs packed indices), or other counts
VARIANTS = ["topk:ratio=0.3,indices=raw", "randomk:ratio=0.3", "threshold:threshold=0.5,indices=packed"]
SPECS = gradwire.available() + CHAINS + VARIANTS
TOTAL_EXAMPLES = int(os.environ.get("GRADWIRE_FUZZ_EXAMPLES", 2400))  # over all specs; at least 100 per spec
EXAMPLES = max(100, math.ceil(TOTAL_EXAMPLES / len(SPECS)))
SHAPES = [(1,), (2,), (37,), (4, 33), (300,), (0,)]
FUZZ_DECODE_LIMIT = 1 << 22  # keeps forged-but-consistent numels from allocating gigabytes
SECONDS_PER_DECODE = 10

ZSTD_CODEC = 14


# ---- the valid packets that get mutated ----------------------------------------------------

def _input(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    n = math.prod(shape)
    g = torch.Generator().manual_seed(n * 7 + len(shape))
    x = torch.randn(n, generator=g)
    x[torch.rand(n, generator=g) < 0.2] = 0.0  # some exact zeros, like ReLU gradients
    return x.reshape(shape).to(dtype)


@lru_cache(maxsize=None)
def _base(spec: str, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, list["Node"]]:
    c = gradwire.compressor(spec)
    x = _input(dtype, shape)
    buf = c.encode(x, Ctx(seed=1, step=2, rank=0, key=3)).tensor()
    assert c.decode(buf).shape == x.shape
    return x, buf, _tree(buf)


@dataclass
class Node:
    """One packet inside the outer one, with a way to put changed bytes back."""

    pk: Packet
    raw: torch.Tensor  # this level's bytes: wire bytes, or a zstd frame's content
    emit: Callable[[torch.Tensor], torch.Tensor]  # changed bytes at this level -> outermost packet bytes
    serialize: Callable[[Packet], torch.Tensor]  # a packet -> this level's bytes
    where: str


def _replace(pk: Packet, i: int, data: torch.Tensor) -> Packet:
    sections = list(pk.sections)
    sections[i] = Section(sections[i].kind, data)
    return Packet(pk.codec, pk.dtype, pk.shape, sections, pk.config, pk.flags)


def _wire_bytes(p: Packet) -> torch.Tensor:
    return Packet(p.codec, p.dtype, p.shape, list(p.sections), p.config, p.flags).tensor()


def _zstd(content: torch.Tensor) -> torch.Tensor:
    frame = zstandard.ZstdCompressor(level=1, write_checksum=True).compress(content.numpy())
    return torch.frombuffer(bytearray(frame), dtype=torch.uint8)


def _tree(buf: torch.Tensor) -> list[Node]:
    nodes: list[Node] = []
    unwrap = gradwire.compressor("zstd").unwrap

    def visit(pk, raw, emit, serialize, where):
        nodes.append(Node(pk, raw, emit, serialize, where))
        if pk.codec == ZSTD_CODEC and pk.kinds() == [Kind.FRAME]:
            inner = unwrap(pk)

            def emit_content(content, pk=pk, emit=emit, serialize=serialize):
                return emit(serialize(_replace(pk, 0, _zstd(content))))

            visit(inner, frame_content(inner), emit_content, frame_content, where + "/frame")
        for i, s in enumerate(pk.sections):
            if s.kind == Kind.NESTED and s.data.dtype == torch.uint8:
                def emit_nested(b, i=i, pk=pk, emit=emit, serialize=serialize):
                    return emit(serialize(_replace(pk, i, b)))

                visit(wire.parse(s.data), s.data, emit_nested, _wire_bytes, where + "/nested")

    visit(wire.parse(buf), buf, lambda b: b, _wire_bytes, "outer")
    return nodes


# ---- mutations --------------------------------------------------------------------------

def _t(b: bytes | bytearray) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8) if len(b) else torch.empty(0, dtype=torch.uint8)


def _edge_values(v: int, width: int, itemsize: int = 1) -> list[int]:
    top = (1 << (8 * width)) - 1
    vals = [0, 1, v + 1, v - 1, v + itemsize, v - itemsize, v + 8, v - 8, 2 * v, v // 2, top, top >> 1,
            (top >> 1) + 1, 255]
    if width == 8:
        vals += [1 << 31, 1 << 32, (1 << 32) + 1, 1 << 40, 1 << 62, 1 << 63]
    return [x & top for x in vals]


def _header_fields(pk: Packet) -> list[tuple[int, str, int]]:
    """(offset, struct format, itemsize hint) of every header field of a packet."""
    ndim, nsec = len(pk.shape), len(pk.sections)
    fields = [(4, "B", 1), (5, "B", 1), (6, "B", 1), (7, "B", 1), (8, "B", 1), (9, "B", 1), (10, "H", 1),
              (12, "I", 1), (16, "Q", 1)]
    fields += [(24 + 8 * i, "Q", 1) for i in range(ndim)]
    table = 24 + 8 * ndim
    for j, s in enumerate(pk.sections):
        size = s.data.element_size()
        fields += [(table + 16 * j, "B", 1), (table + 16 * j + 1, "B", 1), (table + 16 * j + 2, "B", 1),
                   (table + 16 * j + 8, "Q", size)]
    return fields


def mutate_bytes(node: Node, data) -> torch.Tensor:
    b = bytearray(node.raw.numpy().tobytes())
    op = data.draw(st.sampled_from(["truncate", "append", "flip", "header", "numel", "zero_tail"]), label="byte op")
    if op == "truncate" and b:
        b = b[: data.draw(st.integers(0, len(b) - 1), label="keep")]
    elif op == "append":
        b += data.draw(st.binary(min_size=1, max_size=24), label="extra")
    elif op == "flip" and b:
        for _ in range(data.draw(st.integers(1, 4), label="flips")):
            i = data.draw(st.integers(0, len(b) - 1), label="at")
            b[i] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    elif op == "zero_tail" and b:
        i = data.draw(st.integers(0, len(b) - 1), label="from")
        b[i:] = bytes(len(b) - i)
    elif op == "header":
        off, fmt, size = data.draw(st.sampled_from(_header_fields(node.pk)), label="field")
        (v,) = struct.unpack_from("<" + fmt, b, off)
        width = struct.calcsize(fmt)
        new = data.draw(st.sampled_from(_edge_values(v, width, size)) | st.integers(0, (1 << (8 * width)) - 1),
                        label="value")
        struct.pack_into("<" + fmt, b, off, new)
    else:  # numel and shape changed together, so the packet still parses and the codec must check counts
        pk = node.pk
        new = data.draw(st.sampled_from(_edge_values(pk.numel, 8) + [3, 64, 1000, 4096, 1 << 20, 1 << 31]),
                        label="numel")
        if pk.shape:
            struct.pack_into("<Q", b, 24, new)
            for i in range(1, len(pk.shape)):
                struct.pack_into("<Q", b, 24 + 8 * i, 1)
        struct.pack_into("<Q", b, 16, new)
    return node.emit(_t(b))


_INT_INFO = {torch.uint8: (0, 255), torch.int8: (-128, 127), torch.int16: (-(1 << 15), (1 << 15) - 1),
             torch.int32: (-(1 << 31), (1 << 31) - 1), torch.int64: (-(1 << 63), (1 << 63) - 1)}


def _mutate_values(t: torch.Tensor, numel: int, data) -> torch.Tensor:
    t = t.clone()
    n = t.numel()
    if t.dtype in _INT_INFO:
        lo, hi = _INT_INFO[t.dtype]
        op = data.draw(st.sampled_from(["set", "reverse", "duplicate", "shift", "fill"]), label="int op")
        if n == 0:
            return t
        if op == "reverse":
            return t.flip(0)
        if op == "duplicate" and n > 1:
            t[1] = t[0]
            return t
        if op == "shift":
            return t.to(torch.int64).add_(data.draw(st.sampled_from([1, -1, numel]), label="by")).clamp_(lo, hi) \
                .to(t.dtype)
        values = [v for v in (numel, numel + 1, numel - 1, 2 * numel + 5, -1, -2, 0, 1, 255, hi, lo, 1 << 15,
                              (1 << 31) - 1, 1 << 20) if lo <= v <= hi]
        value = data.draw(st.sampled_from(values) | st.integers(lo, hi), label="int value")
        if op == "fill":
            return t.fill_(value)
        for _ in range(data.draw(st.integers(1, 3), label="count")):
            t[data.draw(st.integers(0, n - 1), label="pos")] = value
        return t
    if t.dtype in FLOAT_DTYPES or t.dtype == torch.float64:
        if n == 0:
            return t
        value = data.draw(st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e30, -1e30, 1e-30, 65504.0,
                                           3e38, 1.0, -1.0]), label="float value")
        value = torch.tensor(value, dtype=torch.float64).to(t.dtype)  # out-of-range values become inf
        if data.draw(st.booleans(), label="fill"):
            return t.fill_(value)
        t[data.draw(st.integers(0, n - 1), label="pos")] = value
        return t
    raw = t.view(torch.uint8)  # fp8
    if raw.numel():
        raw[data.draw(st.integers(0, raw.numel() - 1), label="pos")] = data.draw(st.integers(0, 255), label="byte")
    return t


def mutate_sections(node: Node, data) -> torch.Tensor:
    pk = node.pk
    sections = [Section(s.kind, s.data) for s in pk.sections]
    codec, dtype, shape, flags = pk.codec, pk.dtype, pk.shape, pk.flags
    ops = ["values", "grow", "shrink", "drop", "duplicate", "swap", "kind", "retype", "flags", "codec", "dtype"]
    op = data.draw(st.sampled_from(ops if sections else ["flags", "codec", "dtype"]), label="section op")
    i = data.draw(st.integers(0, len(sections) - 1), label="section") if sections else 0
    if op == "values":
        sections[i].data = _mutate_values(sections[i].data, pk.numel, data)
    elif op == "grow":
        s = sections[i].data
        extra = s.new_zeros(data.draw(st.integers(1, 9), label="grow by")) if s.numel() == 0 else \
            s[-1:].repeat(data.draw(st.integers(1, 9), label="grow by"))
        sections[i].data = torch.cat([s, extra])
    elif op == "shrink":
        s = sections[i].data
        sections[i].data = s[: data.draw(st.integers(0, max(0, s.numel() - 1)), label="keep")].clone()
    elif op == "drop":
        del sections[i]
    elif op == "duplicate":
        sections.insert(i, Section(sections[i].kind, sections[i].data.clone()))
    elif op == "swap" and len(sections) > 1:
        j = data.draw(st.integers(0, len(sections) - 1), label="with")
        sections[i], sections[j] = sections[j], sections[i]
    elif op == "kind":
        sections[i].kind = data.draw(st.sampled_from(list(Kind)), label="kind")
    elif op == "retype":
        raw = sections[i].data.contiguous().view(torch.uint8)
        fits = [d for d in DTYPE_CODES if raw.numel() % torch.empty((), dtype=d).element_size() == 0]
        sections[i].data = raw.clone().view(data.draw(st.sampled_from(fits), label="dtype"))
    elif op == "flags":
        flags = data.draw(st.integers(1, 255), label="flags")
    elif op == "codec":
        codec = data.draw(st.integers(0, 255), label="codec")
    elif op == "dtype":
        dtype = data.draw(st.sampled_from(FLOAT_DTYPES), label="tensor dtype")
    new = Packet(codec, dtype, shape, sections, pk.config, flags)
    return node.emit(node.serialize(new))


# ---- the test ---------------------------------------------------------------------------

class DecodeHung(Exception):
    pass


def _alarm(signum, frame):
    raise DecodeHung(f"decode ran longer than {SECONDS_PER_DECODE} s")


@pytest.fixture(scope="module", autouse=True)
def small_decode_limit():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(wire, "MAX_DECODE_NUMEL", FUZZ_DECODE_LIMIT)
        yield


def _header(buf: torch.Tensor) -> bytes | None:
    try:
        pk = wire.parse(buf)
    except WireFormatError:
        return None
    return bytes(buf[: pk.header_nbytes].numpy())


@pytest.mark.parametrize("spec", SPECS)
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(data=st.data())
def test_mutated_packets_raise_only_wire_format_errors(spec, data):
    c = gradwire.compressor(spec)
    dtype = data.draw(st.sampled_from(FLOAT_DTYPES), label="dtype")
    shape = data.draw(st.sampled_from(SHAPES), label="shape")
    x, original, nodes = _base(spec, dtype, shape)
    node = data.draw(st.sampled_from(nodes), label="level")
    if data.draw(st.booleans(), label="structured"):
        bad = mutate_sections(node, data)
    else:
        bad = mutate_bytes(node, data)
    mode = data.draw(st.sampled_from(["none", "none", "out", "wrong out"]), label="out")
    out = None
    if mode == "out":
        out = torch.full(x.shape, 7.0, dtype=dtype)
    elif mode == "wrong out":
        out = torch.full((x.numel() + 1,), 7.0, dtype=dtype)
    same_header = _header(bad) == _header(original)

    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, SECONDS_PER_DECODE)
    try:
        y = c.decode(bad, out=out)
    except WireFormatError:
        return
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    declared = wire.parse(bad)
    if out is not None:
        assert y is out and declared.numel == out.numel()
    else:
        assert isinstance(y, torch.Tensor) and y.shape == declared.shape and y.dtype == declared.dtype
    if same_header:
        assert y.shape == x.shape and y.dtype == x.dtype


def test_the_fuzzer_reaches_every_level():
    """The trees the fuzzer mutates include frame contents and nested packets."""
    _, _, nodes = _base("topk:ratio=0.05+qsgd:bits=4+zstd", torch.float32, (300,))
    assert [n.where for n in nodes] == ["outer", "outer/frame", "outer/frame/nested"]
    for n in nodes:  # putting the unchanged bytes back rebuilds an equivalent packet
        c = gradwire.compressor("topk:ratio=0.05+qsgd:bits=4+zstd")
        assert torch.equal(c.decode(n.emit(n.raw)), c.decode(_base("topk:ratio=0.05+qsgd:bits=4+zstd",
                                                                    torch.float32, (300,))[1]))


def test_examples_add_up():
    assert EXAMPLES * len(SPECS) >= 2000
