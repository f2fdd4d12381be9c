"""Write tests/compress/hostile/corpus.json: hand-crafted hostile packets, by class of issue 11.

    PYTHONPATH=. python tests/compress/hostile/make_corpus.py

Each entry is one buffer a peer could send (hex), what it goes to and what the receiver
expects; tests/compress/test_hostile.py decodes every entry under an address-space limit and wants
WireFormatError (or, standalone, a decode no larger than the receiver allows).

kinds: "packet" (a codec's `decode`), "message" (one rank's int64 length table, then its packets),
"sparse" (one rank's `comm.sparse_exchange` buffer), "artopk" (a leader's broadcast indices).
classes: 1 zero dim beside a huge one, 2 declared numel far above the data, 3 zstd content
size bombs, 4 a packet for another shape, 5 trailing bytes, 6 unknown flag bits, 7 bad outer
packets around a valid inner one, 8 repeated sparse indices, 9 an `out` of another dtype,
10 bad comm.sparse_exchange buffers.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
import zstandard

import gradwire
from gradwire.comm.sparse_exchange import pack
from gradwire.compress import wire
from gradwire.compress.lossless import frame_content
from gradwire.compress.wire import DTYPE_CODES, Kind, Packet, Section

OUT = Path(__file__).with_name("corpus.json")
HUGE = 1 << 32
# every codec, plus chains that nest (value stage) and wrap (lossless)
SPECS = ["none", "fp16", "bf16", "fp8", "fp4", "int8", "qsgd", "terngrad", "sign", "onebit", "topk:k=1", "randomk:k=1",
         "threshold", "dgc:k=1", "zstd", "topk:k=1+fp16", "threshold+int8", "topk:k=1+zstd", "fp16+zstd"]
entries: list[dict] = []


def add(cls: int, name: str, buf: torch.Tensor | bytes, kind: str = "packet", spec: str = "", shape=(4, 5),
        dtype: str = "float32", standalone: str = "raises", **extra) -> None:
    """standalone: "raises" (WireFormatError without expectations too) or "decodes" (a packet
    valid by itself, wrong only for this receiver)."""
    data = bytes(buf.numpy()) if isinstance(buf, torch.Tensor) else bytes(buf)
    entries.append({"class": cls, "name": name, "kind": kind, "spec": spec, "shape": list(shape), "dtype": dtype,
                    "standalone": standalone, "hex": data.hex(), **extra})


def encoded(spec: str, x: torch.Tensor) -> torch.Tensor:
    return gradwire.compressor(spec).encode(x, gradwire.Ctx(seed=1)).tensor()


def with_shape(buf: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The packet with its header's numel and shape rewritten (same ndim)."""
    b = bytearray(buf.numpy().tobytes())
    n = 1
    for s in shape:
        n *= s
    struct.pack_into("<Q", b, 16, n)
    struct.pack_into(f"<{len(shape)}Q", b, 24, *shape)
    return torch.frombuffer(b, dtype=torch.uint8)


def with_byte(buf: torch.Tensor, at: int, value: int) -> torch.Tensor:
    b = buf.clone()
    b[at] = value
    return b


def crc(spec: str) -> int:
    return gradwire.compressor(spec).crc


def sparse_packet(codec: int, config: int, numel: int, dtype=torch.float32,
                  values: torch.Tensor | None = None) -> torch.Tensor:
    """One raw index (0) and one value in a tensor of `numel` elements."""
    idx = torch.zeros(1, dtype=torch.int32 if numel < 2**31 else torch.int64)
    vals = values if values is not None else torch.ones(1, dtype=dtype)
    sections = [Section(Kind.INDICES, idx), Section(Kind.VALUES if values is None or values.dtype != torch.uint8
                                                    else Kind.NESTED, vals)]
    return Packet(codec, dtype, (numel,), sections, config).tensor()


def randomk_packet(config: int, numel: int, k: int, key: int = 0) -> torch.Tensor:
    """A randomk packet (no indices: META holds the key they are drawn from) of k values
    in a tensor of `numel` elements."""
    sections = [Section(Kind.META, torch.tensor([key])), Section(Kind.VALUES, torch.ones(k)),
                Section(Kind.SENTINEL, torch.zeros(1))]
    return Packet(7, torch.float32, (numel,), sections, config).tensor()


def zstd_frame_header(content_size: int, checksum: bool = True) -> bytes:
    """A single-segment zstd frame header declaring `content_size` (8-byte field)."""
    fhd = 0xC0 | 0x20 | (0x04 if checksum else 0)
    return struct.pack("<IB", 0xFD2FB528, fhd) + struct.pack("<Q", content_size)


def rle_block(byte: int, size: int, last: bool) -> bytes:
    header = (size << 3) | (1 << 1) | int(last)
    return header.to_bytes(3, "little") + bytes([byte])


def raw_block(data: bytes, last: bool) -> bytes:
    return ((len(data) << 3) | int(last)).to_bytes(3, "little") + data


def zstd_outer(frame: bytes, shape: tuple[int, ...], config: int, dtype=torch.float32) -> torch.Tensor:
    data = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
    return Packet(14, dtype, shape, [Section(Kind.FRAME, data)], config).tensor()


def build() -> None:
    x20 = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    empty = torch.empty(0, 5)
    # ---- 1: a zero dim beside a dim of 2**63 or more (numel 0 passes the product check)
    for spec in SPECS:
        p = encoded(spec, empty)
        for shape in ((0, 1 << 63), ((1 << 64) - 1, 0)):
            add(1, f"{spec} shape {shape}", with_shape(p, shape), spec=spec, shape=(0, 5))
    # ---- 2: a one-value sparse packet declaring 2**32 elements (16 GiB of zeros)
    add(2, "topk k=1 numel 2**32", sparse_packet(6, crc("topk:k=1"), HUGE), spec="topk:k=1", shape=(20,))
    add(2, "topk k=1 fp16 numel 2**32", sparse_packet(6, crc("topk:k=1"), HUGE, torch.float16), spec="topk:k=1",
        shape=(20,), dtype="float16")
    add(2, "randomk k=1 numel 2**32", randomk_packet(crc("randomk:k=1"), HUGE, 1), spec="randomk:k=1", shape=(20,))
    add(2, "randomk k=4 (one value per 2**30) numel 2**32", randomk_packet(crc("randomk:k=4"), HUGE, 4),
        spec="randomk:k=4", shape=(20,))
    add(2, "threshold numel 2**32", sparse_packet(8, crc("threshold"), HUGE), spec="threshold", shape=(20,))
    add(2, "dgc k=1 numel 2**32", sparse_packet(9, crc("dgc:k=1"), HUGE), spec="dgc:k=1", shape=(20,))
    add(2, "threshold numel 2**28+1 (just above the cap)", sparse_packet(8, crc("threshold"), (1 << 28) + 1),
        spec="threshold", shape=(20,))
    add(2, "threshold numel 2**40", sparse_packet(8, crc("threshold"), 1 << 40), spec="threshold", shape=(20,))
    nested = encoded("int8", torch.ones(1))
    add(2, "threshold+int8 numel 2**32", sparse_packet(8, crc("threshold+int8"), HUGE, values=nested),
        spec="threshold+int8", shape=(20,))
    # ---- 3: zstd frames declaring huge content sizes, and RLE expansion
    for spec in ("zstd", "topk:k=1+zstd"):
        for size in (60 << 30, 1 << 40):
            frame = zstd_frame_header(size) + rle_block(0, 1 << 17, True) + b"\0\0\0\0"
            add(3, f"{spec} frame declares {size} bytes, outer numel 2**32", zstd_outer(frame, (HUGE,), crc(spec)),
                spec=spec, shape=(20,))
        frame = zstd_frame_header(60 << 30) + rle_block(0, 1 << 17, True) + b"\0\0\0\0"
        add(3, f"{spec} frame declares 60 GiB, outer (20,)", zstd_outer(frame, (20,), crc(spec)),
            spec=spec, shape=(20,))
    # RLE blocks: a packet under 1 KB whose frame holds a valid `none` packet of 28 MiB of zeros
    blocks = 225
    n = blocks * (1 << 17) // 4
    inner = Packet(1, torch.float32, (n,), [Section(Kind.DATA, torch.empty(0))], crc("none"))
    head = inner.header_bytes()[:-8] + struct.pack("<Q", 4 * n)  # the section table's length field
    content_size = len(head) + 4 * n
    checksum = zstandard.ZstdCompressor(write_checksum=True).compress(head + bytes(4 * n))[-4:]
    frame = zstd_frame_header(content_size) + raw_block(head, False) + \
        b"".join(rle_block(0, 1 << 17, i == blocks - 1) for i in range(blocks)) + checksum
    rle = zstd_outer(frame, (n,), crc("zstd"))
    assert rle.numel() < 1024
    assert zstandard.ZstdDecompressor().decompress(frame)[: len(head)] == head
    add(3, f"zstd RLE blocks: {rle.numel()} bytes, a valid {4 * n >> 20} MiB none packet", rle, spec="zstd",
        shape=(20,), standalone="decodes", decoded_numel=n)
    no_sum = zstd_outer(zstd_frame_header(content_size, checksum=False) + raw_block(head, False) +
                        b"".join(rle_block(0, 1 << 17, i == blocks - 1) for i in range(blocks)), (n,), crc("zstd"))
    add(3, "zstd RLE blocks without a checksum", no_sum, spec="zstd", shape=(20,))
    # ---- 4: valid packets for another shape than the receiver's (4, 5)
    for spec in ("none", "fp16", "int8", "topk:k=1", "randomk:k=1", "threshold", "zstd", "topk:k=1+fp16",
                 "topk:k=1+zstd"):
        add(4, f"{spec} shape (1,) holding 100", encoded(spec, torch.tensor([100.0])), spec=spec,
            standalone="decodes")
        add(4, f"{spec} shape (5,)", encoded(spec, torch.arange(5.0)), spec=spec, standalone="decodes")
        add(4, f"{spec} shape (5, 4)", encoded(spec, x20.reshape(5, 4)), spec=spec, standalone="decodes")
        add(4, f"{spec} fp16 tensor for an fp32 receiver", encoded(spec, x20.half()), spec=spec,
            standalone="decodes")
    add(4, "topk k=1 (1,) packet of 1e6", encoded("topk:k=1", torch.tensor([1e6])), spec="topk:k=1",
        shape=(20,), standalone="decodes")
    # ---- 5: one rank's message of packets (an int64 length per segment, then the packets: what
    # the allgather strategy, the reduce-scatter and Horovod's optimizer exchange): trailing bytes,
    # a missing packet, an overlong and a negative length
    p = encoded("topk:k=1", x20)
    msg = torch.cat([torch.tensor([p.numel()]).view(torch.uint8), p])
    add(5, "message: trailing bytes", torch.cat([msg, torch.zeros(3, dtype=torch.uint8)]), kind="message",
        spec="topk:k=1", count=1)
    add(5, "message: one packet missing", msg, kind="message", spec="topk:k=1", count=2)
    add(5, "message: length beyond the buffer", torch.cat([torch.tensor([1 << 40]).view(torch.uint8), p]),
        kind="message", spec="topk:k=1", count=1)
    add(5, "message: negative length", torch.cat([torch.tensor([-1]).view(torch.uint8), p]),
        kind="message", spec="topk:k=1", count=1)
    # ---- 6: unknown header flag bits, every codec
    for spec in SPECS:
        p = encoded(spec, x20)
        for flags in ((0xFF, 0x80, 0x02) if "zstd" in spec else (0xFF, 0x01, 0x80)):
            add(6, f"{spec} flags {flags:#04x}", with_byte(p, 7, flags), spec=spec)
    add(6, "zstd flag 0x01 (nvCOMP) on the CPU", with_byte(encoded("zstd", x20), 7, 0x01), spec="zstd")
    z = gradwire.compressor("zstd")
    for spec in ("zstd", "topk:k=1+zstd", "fp16+zstd"):  # a flag bit on the packet inside the frame
        p = gradwire.compressor(spec).encode(x20)
        inner = z.unwrap(p)
        inner.flags = 0x10
        outer = z.wrap(inner)
        outer.config = p.config
        add(6, f"{spec}: inner packet flags 0x10", outer.tensor(), spec=spec)
    p = gradwire.compressor("topk:k=1+fp16").encode(x20.reshape(-1))  # ... and on a nested one
    nested = wire.parse(p.section(Kind.NESTED))
    nested.flags = 0x10
    nested._buffer = None
    secs = [Section(Kind.NESTED, nested.tensor()) if s.kind == Kind.NESTED else s for s in p.sections]
    add(6, "topk:k=1+fp16: nested packet flags 0x10", Packet(p.codec, p.dtype, p.shape, secs, p.config).tensor(),
        spec="topk:k=1+fp16", shape=(20,))
    # ---- 7: a valid inner stage inside a bad outer packet
    for spec in ("topk:k=1+fp16", "threshold+int8"):
        p = gradwire.compressor(spec).encode(x20.reshape(-1))
        secs = list(p.sections)
        idx = secs[0].data.clone()
        idx[-1] = 25
        bad_idx = [Section(Kind.INDICES, idx)] + secs[1:]
        add(7, f"{spec}: outer index out of range", Packet(p.codec, p.dtype, p.shape, bad_idx, p.config).tensor(),
            spec=spec, shape=(20,))
        add(7, f"{spec}: outer codec id", Packet(5, p.dtype, p.shape, secs, p.config).tensor(), spec=spec, shape=(20,))
        add(7, f"{spec}: outer numel 2**32", Packet(p.codec, p.dtype, (HUGE,),
                                                    [Section(Kind.INDICES, torch.zeros(1, dtype=torch.int64))] + secs[1:],
                                                    p.config).tensor(), spec=spec, shape=(20,))
        add(7, f"{spec}: outer section missing", Packet(p.codec, p.dtype, p.shape, secs[1:], p.config).tensor(),
            spec=spec, shape=(20,))
    for spec in ("topk:k=1+zstd", "fp16+zstd"):
        p = gradwire.compressor(spec).encode(x20.reshape(-1))
        add(7, f"{spec}: outer codec id", Packet(6, p.dtype, p.shape, p.sections, p.config).tensor(), spec=spec,
            shape=(20,))
        add(7, f"{spec}: outer config", Packet(14, p.dtype, p.shape, p.sections, crc("zstd")).tensor(), spec=spec,
            shape=(20,))
    # ---- 8: one index repeated by a peer (the sum must still be a sequential one)
    add(8, "sparse: index 3 repeated 60 times", pack(torch.full((60,), 3), torch.full((60,), 0.1), 20),
        kind="sparse", shape=(20,), standalone="decodes")
    # ---- 9: out of another dtype (the packet is valid for a (4, 5) float32 tensor)
    for spec in ("none", "fp16", "topk:k=1", "int8", "zstd", "topk:k=1+fp16"):
        for out_dtype in ("int32", "bool", "float16", "float64"):
            add(9, f"{spec} into an out of {out_dtype}", encoded(spec, x20), spec=spec, standalone="decodes",
                out_dtype=out_dtype)
    # ---- 10: comm.sparse_exchange buffers
    good = pack(torch.tensor([1, 2]), torch.ones(2), 20)
    words = good.view(torch.int64)

    def sparse_with(i: int, v: int) -> torch.Tensor:
        w = words.clone()
        w[i] = v
        return w.view(torch.uint8)
    add(10, "sparse: numel 21 for a 20-element receiver", sparse_with(1, 21), kind="sparse", shape=(20,))
    add(10, "sparse: numel 2**40", sparse_with(1, 1 << 40), kind="sparse", shape=(20,))
    add(10, "sparse: dtype code 99", sparse_with(2, 99), kind="sparse", shape=(20,))
    add(10, "sparse: dtype fp16 for an fp32 receiver", sparse_with(2, DTYPE_CODES[torch.float16]), kind="sparse",
        shape=(20,))
    add(10, "sparse: k = -1", sparse_with(0, -1), kind="sparse", shape=(20,))
    add(10, "sparse: k = 2**60", sparse_with(0, 1 << 60), kind="sparse", shape=(20,))
    add(10, "sparse: index 20", sparse_with(3, 20), kind="sparse", shape=(20,))
    add(10, "sparse: index -1", sparse_with(3, -1), kind="sparse", shape=(20,))
    add(10, "sparse: truncated", good[:-8], kind="sparse", shape=(20,))
    add(10, "sparse: not 8-aligned", good[:-3], kind="sparse", shape=(20,))
    add(10, "sparse: shorter than its header", good[:16], kind="sparse", shape=(20,))
    # artopk: a leader's broadcast indices for two segments of (20,) and (5,)
    for name, idx in (("index beyond its segment", [20, 21]), ("not ascending", [5, 3]), ("negative", [-1, 21]),
                      ("in the other segment", [21, 22])):
        add(4, f"artopk: {name}", torch.tensor(idx).view(torch.uint8), kind="artopk", shape=(25,),
            segments=[20, 5], counts=[1, 1])


def main() -> None:
    build()
    seen = {e["name"] for e in entries}
    assert len(seen) == len(entries), "entry names must be unique"
    OUT.write_text(json.dumps({"generator": "tests/compress/hostile/make_corpus.py", "entries": entries}, indent=0) + "\n")
    print(f"wrote {len(entries)} entries to {OUT}")


if __name__ == "__main__":
    main()
