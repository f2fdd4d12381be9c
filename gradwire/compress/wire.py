"""Wire format v1: a self-describing little-endian byte string (see docs/wire-format.md).

Layout::

    0   magic      4s   b"GWIR"
    4   version    u8   1
    5   codec      u8   codec id of the compressor that wrote it
    6   dtype      u8   element dtype of the decoded tensor
    7   flags      u8   codec-specific bits (0 unless the codec defines them)
    8   ndim       u8   <= MAX_NDIM
    9   nsections  u8   <= MAX_SECTIONS
    10  reserved   u16  0
    12  config     u32  crc32 of the writer's canonical spec (decoder must match)
    16  numel      u64  product of shape
    24  shape      ndim x u64
    ..  sections   nsections x (kind u8, dtype u8, reserved 6 bytes, nbytes u64)
    ..  data       each section's bytes, each starting 8-byte aligned, zero padded

The header is parsed with `struct` on the host; section payloads stay tensors on the
packet's device (views into the buffer, no copies).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum

import torch

from ..errors import WireFormatError
from . import alloc

MAGIC = b"GWIR"
VERSION = 1
MAX_NDIM = 16
MAX_SECTIONS = 16
ALIGN = 8
_FIXED = struct.Struct("<4sBBBBBBHIQ")
_SECTION = struct.Struct("<BB6sQ")
assert _FIXED.size == 24 and _SECTION.size == 16

#: Default cap on the elements standalone `decode` produces when the caller says nothing
#: about the tensor it expects (no ``out``, no ``shape``): a forged numel must not make a
#: 72-byte packet allocate gigabytes. 2**28 fp32 elements = 1 GiB; pass ``max_numel`` to raise it.
MAX_DECODE_NUMEL = 1 << 28

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.uint8: 3,
    torch.int8: 4,
    torch.int16: 5,
    torch.int32: 6,
    torch.int64: 7,
    torch.float8_e4m3fn: 8,
    torch.float8_e5m2: 9,
    torch.float64: 10,
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Kind(IntEnum):
    """What a section holds; a codec checks it finds exactly the kinds it wrote."""

    DATA = 1  # dense payload (casts, quantized codes)
    VALUES = 2  # values of a sparse packet
    INDICES = 3  # raw ascending indices (int32 or int64)
    INDICES_PACKED = 4  # delta + bit-packed indices (see indexcodec)
    SCALES = 5  # per-chunk scales / norms
    OFFSETS = 6  # per-chunk offsets (affine quantizers)
    BITS = 7  # packed bit planes (sign, ternary)
    NESTED = 8  # a complete inner packet (a chain stage)
    FRAME = 9  # lossless codec frame
    META = 10  # small codec-specific integers (e.g. the count of a threshold packet)
    SENTINEL = 11  # one float that is non-finite iff the input was (NaN/Inf propagation)


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class Section:
    kind: Kind
    data: torch.Tensor  # 1-D, contiguous, any dtype in DTYPE_CODES

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass
class Packet:
    """A decoded view of one packet: header fields plus typed section tensors."""

    codec: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    sections: list[Section]
    config: int = 0
    flags: int = 0
    _buffer: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def header_nbytes(self) -> int:
        return header_size(len(self.shape), len(self.sections))

    @property
    def nbytes(self) -> int:
        """Bytes on the wire, header included."""
        return self.header_nbytes + sum(align(s.nbytes) for s in self.sections)

    @property
    def device(self) -> torch.device:
        if self.sections:
            return self.sections[0].data.device
        return self._buffer.device if self._buffer is not None else torch.device("cpu")

    def section(self, kind: Kind) -> torch.Tensor:
        for s in self.sections:
            if s.kind == kind:
                return s.data
        raise WireFormatError(f"packet has no {kind.name} section")

    def kinds(self) -> list[Kind]:
        return [s.kind for s in self.sections]

    def tensor(self) -> torch.Tensor:
        """The packet as one uint8 tensor on its device (built once, then cached)."""
        if self._buffer is None:
            self._buffer = _serialize(self)
        return self._buffer

    def freeze(self) -> "Packet":
        """Serialize now and point the sections at the buffer, so later changes to the
        tensors the sections came from (the caller's gradient, say) cannot alter the packet."""
        self._buffer = None
        buf = self.tensor()
        pos = self.header_nbytes
        for s in self.sections:
            n = s.nbytes
            s.data = buf[pos: pos + n].view(s.data.dtype) if n else s.data.new_empty(0)
            pos += align(n)
        return self

    def header_bytes(self) -> bytes:
        for s in self.sections:
            if s.data.dtype not in DTYPE_CODES:
                raise TypeError(f"section {s.kind.name} has unsupported dtype {s.data.dtype}")
        head = _FIXED.pack(MAGIC, VERSION, self.codec, DTYPE_CODES[self.dtype], self.flags,
                           len(self.shape), len(self.sections), 0, self.config, self.numel)
        head += struct.pack(f"<{len(self.shape)}Q", *self.shape)
        for s in self.sections:
            head += _SECTION.pack(int(s.kind), DTYPE_CODES[s.data.dtype], bytes(6), s.nbytes)
        return head


def allocate(codec: int, dtype: torch.dtype, shape: tuple[int, ...], layout: list[tuple[Kind, torch.dtype, int]],
             config: int = 0, device: torch.device | str = "cpu") -> Packet:
    """A frozen packet whose sections (kind, dtype, element count) are views of its one
    buffer, header and padding written, contents left for the encoder to fill in place:
    saves the copy `freeze` makes of separately built sections."""
    sections = [Section(kind, torch.empty(0, dtype=dt)) for kind, dt, _ in layout]
    pk = Packet(codec, dtype, shape, sections, config)
    head = header_size(len(shape), len(layout))
    sizes = [count * dt.itemsize for _, dt, count in layout]
    buf = _new_buffer(head + sum(align(n) for n in sizes), torch.device(device))
    pos = head
    for sec, (_, dt, count), n in zip(sections, layout, sizes):
        sec.data = buf[pos: pos + n].view(dt)
        buf[pos + n: pos + align(n)].zero_()
        pos += align(n)
    assert sum(s.nbytes for s in sections) == sum(sizes)
    copy_host_bytes(buf[:head], pk.header_bytes())
    pk._buffer = buf
    return pk


def header_size(ndim: int, nsections: int) -> int:
    return _FIXED.size + 8 * ndim + _SECTION.size * nsections


def copy_host_bytes(dst: torch.Tensor, data: bytes) -> None:
    """dst (uint8, len(data) bytes) <- data. A CUDA destination gets an asynchronous copy
    from pinned memory: a pageable host-to-device copy would wait for the whole stream."""
    src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if dst.is_cuda:
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)


def _new_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A packet's buffer: on the CPU a large one is on huge pages (`alloc`: a fresh packet
    of tens of MB would otherwise page-fault more than its encode costs)."""
    return alloc.empty(nbytes, torch.uint8) if device.type == "cpu" else torch.empty(nbytes, dtype=torch.uint8,
                                                                                       device=device)


def _serialize(p: Packet) -> torch.Tensor:
    out = _new_buffer(p.nbytes, p.device)
    head = p.header_bytes()
    copy_host_bytes(out[: len(head)], head)
    pos = len(head)
    for s in p.sections:
        n = s.nbytes
        if n:
            out[pos: pos + n].copy_(s.data.contiguous().view(-1).view(torch.uint8))
        pad = align(n) - n
        if pad:
            out[pos + n: pos + n + pad].zero_()
        pos += align(n)
    return out


def parse(buf: torch.Tensor) -> Packet:
    """Check a packet's structure against its own buffer and return typed section views.

    Only structure is checked here (magic, version, dtypes, lengths, alignment, shape);
    the codec checks its own config, section kinds and contents.
    """
    if not isinstance(buf, torch.Tensor):
        raise WireFormatError(f"a packet must be a uint8 tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise WireFormatError(f"a packet must be a 1-D uint8 tensor, got {buf.dtype} with shape {tuple(buf.shape)}")
    if not buf.is_contiguous() or buf.storage_offset() % ALIGN:
        buf = buf.clone()  # sections are viewed as wider dtypes, which needs aligned storage
    total = buf.numel()
    if total < _FIXED.size:
        raise WireFormatError(f"packet of {total} bytes is shorter than the {_FIXED.size}-byte header")
    # The header is small; one host copy of it is the single sync a device packet needs.
    fixed = bytes(buf[: _FIXED.size].cpu().numpy().tobytes())
    magic, version, codec, dtype_code, flags, ndim, nsec, reserved, config, numel = _FIXED.unpack(fixed)
    if magic != MAGIC:
        raise WireFormatError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise WireFormatError(f"unsupported wire version {version}, this build reads {VERSION}")
    if dtype_code not in CODE_DTYPES or CODE_DTYPES[dtype_code] not in FLOAT_DTYPES:
        raise WireFormatError(f"bad tensor dtype code {dtype_code}")
    if ndim > MAX_NDIM:
        raise WireFormatError(f"ndim {ndim} exceeds {MAX_NDIM}")
    if nsec > MAX_SECTIONS:
        raise WireFormatError(f"section count {nsec} exceeds {MAX_SECTIONS}")
    if reserved != 0:
        raise WireFormatError(f"reserved header field is {reserved}, expected 0")
    hsize = header_size(ndim, nsec)
    if hsize > total:
        raise WireFormatError(f"header needs {hsize} bytes but the packet has {total}")
    rest = bytes(buf[_FIXED.size: hsize].cpu().numpy().tobytes())
    shape = struct.unpack_from(f"<{ndim}Q", rest, 0)
    prod, nonzero = 1, 1
    for s in shape:
        prod *= s
        nonzero *= max(s, 1)
    if prod != numel:
        raise WireFormatError(f"numel {numel} does not equal the product of shape {shape}")
    if nonzero >= 1 << 63:  # a zero dim beside huge ones: numel 0, but no tensor has that shape
        raise WireFormatError(f"shape {shape}: the product of its non-zero dims is not below 2**63")
    sections: list[Section] = []
    pos = hsize
    for i in range(nsec):
        kind_code, sdtype_code, sreserved, nbytes = _SECTION.unpack_from(rest, 8 * ndim + _SECTION.size * i)
        if sreserved != bytes(6):
            raise WireFormatError(f"section {i}: reserved bytes are not zero")
        try:
            kind = Kind(kind_code)
        except ValueError:
            raise WireFormatError(f"section {i}: unknown kind {kind_code}") from None
        if sdtype_code not in CODE_DTYPES:
            raise WireFormatError(f"section {i} ({kind.name}): unknown dtype code {sdtype_code}")
        sdtype = CODE_DTYPES[sdtype_code]
        itemsize = sdtype.itemsize
        if nbytes % itemsize:
            raise WireFormatError(f"section {i} ({kind.name}): {nbytes} bytes is not a multiple of {sdtype} size")
        if nbytes > total - pos:
            raise WireFormatError(f"section {i} ({kind.name}): length {nbytes} runs past the end of the packet")
        view = buf[pos: pos + nbytes]
        sections.append(Section(kind, view.view(sdtype) if nbytes else torch.empty(0, dtype=sdtype, device=buf.device)))
        pos += align(nbytes)
    if pos != total:
        raise WireFormatError(f"packet is {total} bytes but its header describes {pos}")
    return Packet(codec, CODE_DTYPES[dtype_code], tuple(shape), sections, config, flags, buf)
