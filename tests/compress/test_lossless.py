"""`zstd`: bit-exact round trips, byte planes that pay off, and frames that fail loudly."""

from __future__ import annotations

import functools
import struct

import pytest
import torch
import zstandard

import gradwire
from gradwire import WireFormatError
from gradwire.compress import lossless, wire
from gradwire.compress.lossless import content_bound, frame_content, merge_planes, split_planes
from gradwire.compress.wire import FLOAT_DTYPES, Kind, Packet, Section

from tensors import bits, mlp_gradient, randn

ZSTD = gradwire.compressor("zstd")


def special_values(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    """Random values with NaNs of several payloads and signs, +-Inf, -0.0 and subnormals mixed in."""
    x = randn(n, dtype, seed)
    if n == 0:
        return x
    raw = bits(x)  # a view: writes land in x
    patterns = {
        torch.float32: [0x7FC00000, 0x7F800001, 0x7FA12345, -0x003EDCBB, 0x7F800000, -0x00800000, -0x80000000, 0x1],
        torch.float16: [0x7E00, 0x7C01, 0x7D55, -0x0155, 0x7C00, -0x0400, -0x8000, 0x1],
        torch.bfloat16: [0x7FC0, 0x7F81, 0x7FA5, -0x0055, 0x7F80, -0x0080, -0x8000, 0x1],
    }[dtype]
    g = torch.Generator().manual_seed(seed + 1)
    pos = torch.randperm(n, generator=g)[: len(patterns)]
    raw[pos] = torch.tensor(patterns[: pos.numel()], dtype=raw.dtype)
    return x


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(0,), (1,), (), (2,), (3,), (7,), (5, 0), (3, 7), (2, 3, 5), (1001,), (4097,)])
def test_round_trip_is_bit_exact(dtype, shape):
    n = 1
    for s in shape:
        n *= s
    x = special_values(dtype, n).reshape(shape)
    packet = ZSTD.encode(x)
    assert packet.codec == 14 and packet.kinds() == [Kind.FRAME]
    assert packet.dtype == dtype and packet.shape == tuple(shape) and packet.config == ZSTD.crc
    y = ZSTD.decode(packet.tensor())
    assert y.shape == x.shape and y.dtype == dtype
    assert torch.equal(bits(y), bits(x))
    out = torch.empty(shape, dtype=dtype)
    assert ZSTD.decode(packet.tensor(), out=out) is out
    assert torch.equal(bits(out), bits(x))


@pytest.mark.parametrize("level", [1, 3, 9, 19, 22])
def test_every_level_round_trips(level):
    c = gradwire.compressor(f"zstd:level={level}")
    x = special_values(torch.float32, 3000, seed=level)
    p = c.encode(x)
    assert torch.equal(bits(c.decode(p.tensor())), bits(x))
    with pytest.raises(WireFormatError, match="config checksum"):
        (gradwire.compressor("zstd:level=2") if level != 2 else ZSTD).decode(p.tensor())


def test_input_is_not_aliased():
    x = randn(100)
    p = ZSTD.encode(x)
    x.zero_()
    assert torch.count_nonzero(ZSTD.decode(p.tensor())) == 100


def test_contract_flags_and_params():
    assert ZSTD.role == "lossless" and ZSTD.codec_id == 14 and not ZSTD.summable
    assert ZSTD.static_size(100) is None
    assert ZSTD.level == 3 and str(ZSTD) == "zstd" and str(gradwire.compressor("zstd:level=7")) == "zstd:level=7"
    with pytest.raises(TypeError, match="not summable"):
        ZSTD.to_summable(torch.zeros(3))
    for bad in ("0", "23", "-1", "2.5", "fast"):
        with pytest.raises(ValueError, match="level"):
            gradwire.compressor(f"zstd:level={bad}")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("n", [0, 1, 3, 64])
def test_byte_planes_layout(dtype, n):
    x = special_values(dtype, n)
    planes = split_planes(x)
    s = x.element_size()
    assert planes.dtype == torch.uint8 and planes.numel() == n * s
    # each element's bits rotated left by one (sign to bit 0, exponent to the top byte), then split
    words = [int.from_bytes(bytes(x[i: i + 1].view(torch.uint8).tolist()), "little") for i in range(n)]
    width = 8 * s
    rotated = [((w << 1) | (w >> (width - 1))) & ((1 << width) - 1) for w in words]
    raw = torch.tensor([list(r.to_bytes(s, "little")) for r in rotated], dtype=torch.uint8).reshape(n, s)
    for k in range(s):
        assert torch.equal(planes[k * n:(k + 1) * n], raw[:, k])
    assert torch.equal(bits(merge_planes(planes, dtype)), bits(x))
    out = torch.full((n * s,), 0xAA, dtype=torch.uint8)
    assert torch.equal(bits(merge_planes(planes, dtype, out=out)), bits(x))


def _mixed_packet() -> Packet:
    """A packet with float and non-float sections of every width, as a sparse codec would write."""
    g = torch.Generator().manual_seed(5)
    return Packet(codec=6, dtype=torch.bfloat16, shape=(10, 20), flags=3, config=0xDEADBEEF, sections=[
        Section(Kind.INDICES, torch.tensor([1, 5, 7, 199], dtype=torch.int64)),
        Section(Kind.VALUES, torch.randn(4, generator=g).to(torch.bfloat16)),
        Section(Kind.SCALES, torch.randn(3, generator=g)),
        Section(Kind.SENTINEL, torch.tensor([float("nan")], dtype=torch.float16)),
        Section(Kind.BITS, torch.tensor([1, 2, 3], dtype=torch.uint8)),
        Section(Kind.META, torch.tensor([4, -1], dtype=torch.int32)),
        Section(Kind.OFFSETS, torch.tensor([-3], dtype=torch.int16)),
        Section(Kind.DATA, torch.empty(0)),
    ])


def test_wrap_unwrap_restores_any_packet_exactly():
    inner = _mixed_packet()
    outer = ZSTD.wrap(inner)
    assert outer.codec == 14 and outer.dtype == inner.dtype and outer.shape == inner.shape
    assert outer.kinds() == [Kind.FRAME] and outer.sections[0].data.dtype == torch.uint8
    back = ZSTD.unwrap(wire.parse(outer.tensor()))
    assert torch.equal(back.tensor(), inner.tensor())
    assert (back.codec, back.flags, back.config) == (6, 3, 0xDEADBEEF)


def test_frame_content_splits_float_sections_only():
    inner = _mixed_packet()
    content = frame_content(inner)
    head = inner.header_bytes()
    assert bytes(content[: len(head)].numpy()) == head
    pos = len(head)
    for s in inner.sections:
        n = s.nbytes
        chunk = content[pos: pos + n]
        if s.data.dtype in FLOAT_DTYPES:
            assert torch.equal(chunk, split_planes(s.data))
        else:
            assert torch.equal(chunk, s.data.view(torch.uint8))
        pos += n
    assert pos == content.numel()  # no padding inside the frame
    raw = bytes(lossless.frame_content(inner).numpy())
    assert zstandard.ZstdDecompressor().decompress(ZSTD.wrap(inner).sections[0].data.numpy()) == raw


@functools.lru_cache(maxsize=None)
def _fp32_gradient() -> torch.Tensor:
    return mlp_gradient(seed=0)


def _gradient(dtype: torch.dtype) -> torch.Tensor:
    return _fp32_gradient().to(dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_byte_planes_beat_plain_zstd_on_real_gradients(dtype):
    g = _gradient(dtype)
    assert g.numel() > 100_000 and 0.001 < g.abs().max() < 100
    plain = len(zstandard.ZstdCompressor(level=3).compress(g.view(torch.uint8).numpy()))
    packet = ZSTD.encode(g)
    ours = packet.sections[0].data.numel()
    raw = g.numel() * g.element_size()
    # Measured: fp32 1.08x -> 1.15x, fp16 1.09x -> 1.12x, bf16 1.28x -> 1.36x.
    assert ours < 0.98 * plain, f"{dtype}: planes {raw / ours:.3f}x vs plain zstd {raw / plain:.3f}x"
    assert packet.nbytes < raw
    assert torch.equal(bits(ZSTD.decode(packet.tensor())), bits(g))


# ---- malformed frames -----------------------------------------------------------------

def _outer(frame: bytes | torch.Tensor, dtype=torch.float32, shape=(50,), codec=14, config=None,
           sections=None) -> torch.Tensor:
    data = frame if isinstance(frame, torch.Tensor) else torch.frombuffer(bytearray(frame), dtype=torch.uint8) \
        if frame else torch.empty(0, dtype=torch.uint8)
    secs = sections if sections is not None else [Section(Kind.FRAME, data)]
    return Packet(codec, dtype, shape, secs, ZSTD.crc if config is None else config).tensor()


def _frame_of(content: bytes, **kw) -> bytes:
    return zstandard.ZstdCompressor(level=3, write_checksum=True, **kw).compress(content)


def _good(n: int = 50, dtype=torch.float32):
    x = randn(n, dtype, seed=9)
    p = ZSTD.encode(x)
    return x, p, bytes(p.sections[0].data.numpy()), bytes(frame_content(gradwire.compressor("none").encode(x)).numpy())


def test_every_single_bit_flip_in_a_frame_is_caught_or_harmless():
    x, _, frame, _ = _good(40)
    caught = 0
    for i in range(len(frame)):
        for bit in (0, 3, 7):
            bad = bytearray(frame)
            bad[i] ^= 1 << bit
            try:
                y = ZSTD.decode(_outer(bytes(bad), shape=(40,)))
            except WireFormatError:
                caught += 1
            else:  # only flips zstd ignores (e.g. the window size) may decode, and then exactly
                assert torch.equal(bits(y), bits(x)), f"byte {i} bit {bit} decoded to different data"
    assert caught >= 0.9 * 3 * len(frame)


@pytest.mark.parametrize("cut", [0, 1, 4, 5, 10, -5, -4, -1])
def test_truncated_frame(cut):
    _, _, frame, _ = _good()
    with pytest.raises(WireFormatError):
        ZSTD.decode(_outer(frame[:cut]))


def test_frame_errors_name_the_problem():
    x, _, frame, content = _good()
    cases = {
        "trailing data": (frame + b"\x00", "does not decompress"),
        "second frame": (frame + frame, "does not decompress"),
        "garbage": (b"\x00" * 64, "malformed"),
        "no content size": (_frame_of(content, write_content_size=False), "content size"),
        "content too short": (_frame_of(content[:10]), "shorter than a packet header"),
        "content cut": (_frame_of(content[:-4]), "describes"),
        "content extended": (_frame_of(content + b"\x00" * 4), "describes"),
        "bad inner magic": (_frame_of(b"XXXX" + content[4:]), "magic"),
    }
    resized = {"content too short", "content cut", "content extended"}
    for name, (bad, message) in cases.items():
        # standalone, the content size is exact: a resized content fails on the frame header
        with pytest.raises(WireFormatError, match="declares" if name in resized else message):
            ZSTD.decode(_outer(bad))
        with pytest.raises(WireFormatError, match=message):
            ZSTD.unwrap(wire.parse(_outer(bad)))
    assert torch.equal(ZSTD.decode(_outer(frame)), x)  # the helper itself builds a valid packet


def test_content_bound_is_checked_before_decompressing():
    numel = 3
    bound = content_bound(numel)
    big = _frame_of(b"\x00" * (bound + 1))  # a zstd bomb: tiny frame, large content
    assert len(big) < 200
    with pytest.raises(WireFormatError, match="declares"):
        ZSTD.decode(_outer(big, shape=(numel,)))
    # Frames whose header lies about the content size: zstd must notice, we must say so.
    x, _, _, content = _good(100)
    frame = bytearray(_frame_of(content))
    assert frame[4] & 0xE0 == 0x60 and 256 <= len(content) < 65536  # 2-byte size field, single segment
    for delta in (-8, -1, 1, 8):
        bad = bytearray(frame)
        struct.pack_into("<H", bad, 5, len(content) - 256 + delta)
        with pytest.raises(WireFormatError):
            ZSTD.decode(_outer(bytes(bad), shape=(100,)))
    assert torch.equal(ZSTD.decode(_outer(bytes(frame), shape=(100,))), x)


def test_inner_packet_must_match_the_outer_header():
    _, _, frame, _ = _good(50)
    with pytest.raises(WireFormatError, match="declares"):
        ZSTD.decode(_outer(frame, shape=(5, 10)))
    with pytest.raises(WireFormatError, match="declares"):
        ZSTD.decode(_outer(frame, dtype=torch.float16))
    # a valid frame holding an fp16 packet is not a standalone zstd packet
    fp16 = gradwire.compressor("fp16").encode(randn(50).half())  # the same content size as `none`'s
    with pytest.raises(WireFormatError, match="'none' packet"):
        ZSTD.decode(ZSTD.wrap(fp16).tensor())
    with pytest.raises(WireFormatError, match="declares"):  # 2 bytes per element, `none` needs 4
        ZSTD.decode(ZSTD.wrap(gradwire.compressor("fp16").encode(randn(50))).tensor())


def test_inner_section_table_is_checked_before_allocating():
    _, _, _, content = _good(50)
    hsize = wire.header_size(1, 1)
    table = hsize - 16
    # section length far beyond the content (would be a huge allocation if trusted)
    bad = bytearray(content)
    struct.pack_into("<Q", bad, table + 8, 1 << 60)
    with pytest.raises(WireFormatError, match="describes"):
        ZSTD.decode(_outer(_frame_of(bytes(bad))))
    bad = bytearray(content)
    bad[table + 1] = 99  # unknown dtype code
    with pytest.raises(WireFormatError, match="dtype code"):
        ZSTD.decode(_outer(_frame_of(bytes(bad))))
    bad = bytearray(content)
    struct.pack_into("<Q", bad, table + 8, 50 * 4 - 2)  # not a multiple of 4
    with pytest.raises(WireFormatError, match="multiple"):  # (decode stops at the content size)
        ZSTD.unwrap(wire.parse(_outer(_frame_of(bytes(bad[:-2])))))
    with pytest.raises(WireFormatError, match="declares"):
        ZSTD.decode(_outer(_frame_of(bytes(bad[:-2]))))
    bad = bytearray(content)
    bad[9] = 17  # nsections
    with pytest.raises(WireFormatError, match="section count"):
        ZSTD.decode(_outer(_frame_of(bytes(bad))))
    bad = bytearray(content)
    bad[8] = 200  # ndim
    with pytest.raises(WireFormatError, match="ndim"):
        ZSTD.decode(_outer(_frame_of(bytes(bad))))
    bad = bytearray(content)
    bad[9] = 5  # header needs more than the content has
    with pytest.raises(WireFormatError):
        ZSTD.decode(_outer(_frame_of(bytes(bad[: hsize + 40]))))


def test_outer_packet_structure():
    _, p, frame, _ = _good(50)
    with pytest.raises(WireFormatError, match="FRAME"):
        ZSTD.decode(_outer(b"", sections=[Section(Kind.DATA, torch.frombuffer(bytearray(frame), dtype=torch.uint8))]))
    with pytest.raises(WireFormatError, match="expected sections"):
        ZSTD.decode(_outer(b"", sections=[p.sections[0], p.sections[0]]))
    with pytest.raises(WireFormatError, match="dtype"):
        ZSTD.decode(_outer(b"", sections=[Section(Kind.FRAME, torch.zeros(4, dtype=torch.int32))]))
    with pytest.raises(WireFormatError, match="codec id"):
        ZSTD.decode(_outer(frame, codec=1))
    with pytest.raises(WireFormatError, match="codec id"):
        gradwire.compressor("none").decode(p.tensor())
    with pytest.raises(WireFormatError, match="out has"):
        ZSTD.decode(p.tensor(), out=torch.empty(49))
