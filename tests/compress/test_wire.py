"""Wire format v1: header round trips and every structural check of `wire.parse`."""

from __future__ import annotations

import struct

import pytest
import torch

import gradwire
from gradwire import WireFormatError
from gradwire.compress import wire
from gradwire.compress.base import expect
from gradwire.compress.wire import DTYPE_CODES, Kind, Packet, Section, header_size, parse

from tensors import randn

NONE = gradwire.compressor("none")
FP16 = gradwire.compressor("fp16")


def _packet(shape=(3, 5), dtype=torch.float32, **kw) -> Packet:
    n = 1
    for s in shape:
        n *= s
    data = randn(n, dtype, seed=1)
    return Packet(kw.pop("codec", 1), dtype, tuple(shape), kw.pop("sections", [Section(Kind.DATA, data)]),
                  kw.pop("config", NONE.crc), **kw)


def _bytes(p: Packet) -> bytearray:
    return bytearray(p.tensor().numpy().tobytes())


def _t(b: bytes | bytearray) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8) if len(b) else torch.empty(0, dtype=torch.uint8)


SECTION_DTYPES = list(DTYPE_CODES)


@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (2, 3), (1,) * 16, (2, 0, 3)])
@pytest.mark.parametrize("dtype", wire.FLOAT_DTYPES)
def test_header_fields_round_trip(shape, dtype):
    g = torch.Generator().manual_seed(len(shape))
    sections = []
    for i, sdtype in enumerate(SECTION_DTYPES + SECTION_DTYPES[:2]):  # 13 sections, every dtype, lengths 0..12
        size = torch.empty((), dtype=sdtype).element_size()
        raw = torch.randint(0, 256, (i * size,), generator=g, dtype=torch.uint8)
        sections.append(Section(Kind(1 + i % 11), raw.view(sdtype)))
    p = Packet(codec=200, dtype=dtype, shape=shape, sections=sections, config=0xFEDCBA98, flags=0xA5)
    buf = p.tensor()
    assert buf.dtype == torch.uint8 and buf.numel() == p.nbytes and buf.numel() % 8 == 0
    q = parse(buf)
    assert (q.codec, q.dtype, q.shape, q.config, q.flags) == (200, dtype, tuple(shape), 0xFEDCBA98, 0xA5)
    assert q.numel == p.numel and q.header_nbytes == header_size(len(shape), 13)
    assert q.kinds() == p.kinds()
    for a, b in zip(p.sections, q.sections):
        assert b.data.dtype == a.data.dtype and b.data.numel() == a.data.numel()
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert torch.equal(q.tensor(), buf)


def test_layout_is_little_endian_and_padded():
    p = _packet(shape=(3,), sections=[Section(Kind.INDICES, torch.tensor([1, 2, 3], dtype=torch.int16)),
                                      Section(Kind.DATA, torch.tensor([1.0, 2.0, 3.0]))])
    b = bytes(_bytes(p))
    assert b[:4] == b"GWIR" and b[4] == 1 and b[5] == 1 and b[6] == 0 and b[8] == 1 and b[9] == 2
    assert struct.unpack_from("<HIQQ", b, 10) == (0, NONE.crc, 3, 3)
    assert struct.unpack_from("<BB6xQ", b, 32) == (Kind.INDICES, DTYPE_CODES[torch.int16], 6)
    assert struct.unpack_from("<BB6xQ", b, 48) == (Kind.DATA, DTYPE_CODES[torch.float32], 12)
    assert struct.unpack_from("<3h2x", b, 64) == (1, 2, 3) and b[70:72] == b"\0\0"
    assert struct.unpack_from("<3f", b, 72) == (1.0, 2.0, 3.0) and b[84:88] == b"\0\0\0\0"
    assert len(b) == 88


# ---- every structural check --------------------------------------------------------------

def _corrupt(edit) -> torch.Tensor:
    b = _bytes(_packet())
    edited = edit(b)
    b = b if edited is None else edited
    return _t(b)


def _set(fmt: str, offset: int, value):
    def edit(b: bytearray):
        struct.pack_into(fmt, b, offset, value)
    return edit


SEC0 = header_size(2, 0)  # the section table of a 2-D packet with one section starts here

CASES = {
    "magic": (_set("<4s", 0, b"GWIX"), "bad magic"),
    "version 0": (_set("<B", 4, 0), "unsupported wire version"),
    "version 2": (_set("<B", 4, 2), "unsupported wire version"),
    "dtype code unknown": (_set("<B", 6, 99), "bad tensor dtype code"),
    "dtype code not float": (_set("<B", 6, DTYPE_CODES[torch.int32]), "bad tensor dtype code"),
    "dtype code fp64": (_set("<B", 6, DTYPE_CODES[torch.float64]), "bad tensor dtype code"),
    "ndim": (_set("<B", 8, 17), "ndim 17 exceeds"),
    "nsections": (_set("<B", 9, 17), "section count 17 exceeds"),
    "reserved low": (_set("<H", 10, 1), "reserved"),
    "reserved high": (_set("<H", 10, 0x8000), "reserved"),
    "numel": (_set("<Q", 16, 16), "does not equal the product"),
    "numel huge": (_set("<Q", 16, 1 << 63), "does not equal the product"),
    "shape": (_set("<Q", 24, 4), "does not equal the product"),
    "section kind 0": (_set("<B", SEC0, 0), "unknown kind"),
    "section kind 12": (_set("<B", SEC0, 12), "unknown kind"),
    "section dtype": (_set("<B", SEC0 + 1, 11), "unknown dtype code"),
    "section past end": (_set("<Q", SEC0 + 8, 15 * 4 + 8), "runs past the end"),
    "section length huge": (_set("<Q", SEC0 + 8, (1 << 64) - 4), "runs past the end"),
    "unaligned length": (_set("<Q", SEC0 + 8, 15 * 4 - 2), "not a multiple"),
    "length odd for fp16": (lambda b: struct.pack_into("<BQ", b, SEC0 + 1, 1, 0) or
                            struct.pack_into("<Q", b, SEC0 + 8, 7), "not a multiple"),
    "short section": (_set("<Q", SEC0 + 8, 14 * 4), "describes"),
    "trailing bytes": (lambda b: b + bytearray(8), "describes"),
    "trailing byte": (lambda b: b + bytearray(1), "describes"),
    "truncated body": (lambda b: b[:-8], "runs past the end"),
    "truncated header": (lambda b: b[: SEC0 + 4], "header needs"),
    "truncated fixed header": (lambda b: b[:23], "shorter than the 24-byte header"),
    "empty": (lambda b: bytearray(), "shorter than"),
    "more sections than present": (_set("<B", 9, 3), "header needs|runs past"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_parse_rejects(case):
    edit, message = CASES[case]
    buf = _corrupt(edit)
    with pytest.raises(WireFormatError, match=message):
        parse(buf)
    with pytest.raises(WireFormatError, match=message):
        NONE.decode(buf)


def test_the_unedited_packet_parses():
    assert torch.equal(NONE.decode(_corrupt(lambda b: None)), randn(15, seed=1).reshape(3, 5))


@pytest.mark.parametrize("bad", [torch.zeros(32, dtype=torch.int8), torch.zeros(4, 8, dtype=torch.uint8),
                                 torch.zeros((), dtype=torch.uint8), bytes(32), [0] * 32])
def test_packet_must_be_a_1d_uint8_tensor(bad):
    with pytest.raises(WireFormatError, match="uint8"):
        parse(bad)


def test_codec_and_config_mismatch():
    p = FP16.encode(randn(10))
    with pytest.raises(WireFormatError, match="codec id 2 is not none"):
        NONE.decode(p.tensor())
    forged = _bytes(p)
    struct.pack_into("<I", forged, 12, p.config ^ 1)
    with pytest.raises(WireFormatError, match="config checksum"):
        FP16.decode(_t(forged))


def test_expect_checks_kind_dtype_and_count():
    p = _packet(shape=(4,), sections=[Section(Kind.DATA, torch.zeros(4))])
    assert expect(p, (Kind.DATA, torch.float32, 4))[0].numel() == 4
    assert expect(p, (Kind.DATA, (torch.float16, torch.float32), None))
    for spec, message in [((Kind.VALUES, torch.float32, 4), "expected a VALUES section"),
                          ((Kind.DATA, torch.float16, 4), "dtype"),
                          ((Kind.DATA, torch.float32, 5), "4 elements, expected 5")]:
        with pytest.raises(WireFormatError, match=message):
            expect(p, spec)
    with pytest.raises(WireFormatError, match="expected sections"):
        expect(p, (Kind.DATA, torch.float32, 4), (Kind.META, torch.int32, 1))
    with pytest.raises(WireFormatError, match="no SCALES section"):
        p.section(Kind.SCALES)


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16", "zstd"])
def test_out_numel_mismatch(spec):
    c = gradwire.compressor(spec)
    p = c.encode(randn((4, 5)))
    for out in (torch.full((19,), 7.0), torch.full((21,), 7.0), torch.empty(0), torch.full((4, 6), 7.0)):
        sentinel = out.clone()
        with pytest.raises(WireFormatError, match="20 elements but out has"):
            c.decode(p.tensor(), out=out)
        assert torch.equal(out, sentinel)  # nothing written
    out = torch.empty(2, 10)  # same numel, other shape: filled in out's shape
    assert c.decode(p, out=out) is out and torch.equal(out.reshape(4, 5), c.decode(p))


def test_max_decode_numel_guard(monkeypatch):
    assert wire.MAX_DECODE_NUMEL == 1 << 28
    huge = Packet(1, torch.float32, (1 << 33,), [Section(Kind.DATA, torch.empty(0))], NONE.crc).tensor()
    with pytest.raises(WireFormatError, match="exceeds the decode limit"):
        NONE.decode(huge)
    above = Packet(6, torch.float32, ((1 << 28) + 1,), [Section(Kind.INDICES, torch.zeros(1, dtype=torch.int32)),
                                                       Section(Kind.VALUES, torch.ones(1))],
                   gradwire.compressor("topk:k=1").crc).tensor()
    topk = gradwire.compressor("topk:k=1")
    with pytest.raises(WireFormatError, match="exceeds the decode limit"):
        topk.decode(above)  # would allocate 1 GiB
    with pytest.raises(WireFormatError, match="exceeds the decode limit 1000"):
        topk.decode(topk.encode(randn(1001)), max_numel=1000)
    assert topk.decode(topk.encode(randn(1001)), max_numel=1001).shape == (1001,)
    x = randn(11)
    monkeypatch.setattr(wire, "MAX_DECODE_NUMEL", 10)
    for spec in ("none", "fp16", "zstd"):
        c = gradwire.compressor(spec)
        p = c.encode(x).tensor()
        with pytest.raises(WireFormatError, match="exceeds the decode limit"):
            c.decode(p)
        out = torch.empty(11)
        assert torch.equal(c.decode(p, out=out), x.half().float() if spec == "fp16" else x)
        assert c.decode(c.encode(randn(10)).tensor()).shape == (10,)


@pytest.mark.parametrize("spec", ["none", "fp16", "zstd", "topk:ratio=0.2", "topk:ratio=0.2+int8+zstd"])
def test_decode_checks_what_the_receiver_expects(spec):
    c = gradwire.compressor(spec)
    x = randn((4, 5))
    p = c.encode(x).tensor()
    assert c.decode(p, shape=(4, 5), dtype=torch.float32).shape == (4, 5)
    for shape in ((20,), (5, 4), (1,), (4, 5, 1)):
        with pytest.raises(WireFormatError, match="receiver expects"):
            c.decode(p, shape=shape)
    with pytest.raises(WireFormatError, match="receiver expects"):
        c.decode(p, shape=(4, 5), dtype=torch.float16)
    # out must match in numel and dtype: no silent cast into int32 or bool
    for out in (torch.zeros(4, 5, dtype=torch.int32), torch.zeros(20, dtype=torch.bool), torch.zeros(20).half()):
        sentinel = out.clone()
        with pytest.raises(WireFormatError, match="out is"):
            c.decode(p, out=out)
        assert torch.equal(out, sentinel)


@pytest.mark.parametrize("spec", ["none", "fp16", "int8", "topk:ratio=0.2", "topk:ratio=0.2+fp16"])
def test_unknown_flag_bits_are_rejected(spec):
    c = gradwire.compressor(spec)
    p = c.encode(randn(30)).tensor().clone()
    for flags in (0x01, 0x80, 0xFF):
        p[7] = flags
        with pytest.raises(WireFormatError, match="flag bits"):
            c.decode(p)


def test_shapes_with_a_zero_dim_beside_huge_ones_are_rejected():
    for shape in ((0, 1 << 63), (1 << 63, 0), (0, 1 << 62, 2), (0, (1 << 64) - 1)):
        p = Packet(1, torch.float32, shape, [Section(Kind.DATA, torch.empty(0))], NONE.crc).tensor()
        with pytest.raises(WireFormatError, match="non-zero dims"):
            NONE.decode(p)
    ok = Packet(1, torch.float32, (0, (1 << 63) - 1), [Section(Kind.DATA, torch.empty(0))], NONE.crc).tensor()
    assert NONE.decode(ok).shape == (0, (1 << 63) - 1)


@pytest.mark.parametrize("offset", [1, 2, 3, 4, 5, 7, 8, 13])
@pytest.mark.parametrize("spec", ["none", "fp16", "zstd"])
def test_packets_at_unaligned_storage_offsets_parse(offset, spec):
    c = gradwire.compressor(spec)
    x = randn((6, 7), seed=offset)
    p = c.encode(x).tensor()
    holder = torch.zeros(offset + p.numel() + 5, dtype=torch.uint8)
    holder[offset: offset + p.numel()] = p
    view = holder[offset: offset + p.numel()]
    assert view.storage_offset() == offset
    assert torch.equal(c.decode(view), c.decode(p))
    assert parse(view).shape == (6, 7)
    strided = torch.zeros(2 * p.numel(), dtype=torch.uint8)[::2]
    strided.copy_(p)
    assert not strided.is_contiguous() and torch.equal(c.decode(strided), c.decode(p))


def test_parsed_sections_view_the_buffer_without_copies():
    p = NONE.encode(randn(16)).tensor()
    q = parse(p)
    assert q.sections[0].data.data_ptr() == p.data_ptr() + q.header_nbytes


def test_encode_freezes_the_packet():
    x = randn(8)
    p = FP16.encode(x)
    x.fill_(7)
    assert torch.equal(FP16.decode(p.tensor()), randn(8).half().float())


def test_nonzero_section_reserved_bytes_are_rejected():
    import gradwire
    from gradwire.compress import wire

    raw = gradwire.compressor("fp16").encode(torch.randn(10)).tensor().clone()
    entry = wire.header_size(1, 0)  # the first section-table entry starts here
    raw[entry + 3] = 1  # inside the 6 reserved bytes
    with pytest.raises(gradwire.WireFormatError, match="reserved"):
        wire.parse(raw)
