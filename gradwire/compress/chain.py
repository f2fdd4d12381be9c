"""Chains: ``sparsifier [+ value quantizer] [+ lossless]`` or ``dense [+ lossless]``.

A value stage encodes the sparsifier's VALUES section into a complete inner packet that
replaces it as a NESTED section; a lossless stage wraps the whole packet in a frame.
The outermost packet carries the chain's config checksum, inner ones their stage's.

No kernels of its own: each stage runs its codec's. Tests: tests/compress/test_chain.py.
"""

from __future__ import annotations

import zlib
from typing import Iterator

import torch

from ..errors import WireFormatError
from . import wire
from .base import Compressor, Ctx, Piece, _add_pieces, check_expected, check_input, deliver
from .names import register_composite
from .wire import Kind, Packet, Section


@register_composite
class Chain(Compressor):
    name = "chain"
    codec_id = 0  # never on the wire: the outer packet carries its last stage's codec

    def __init__(self, stages: list[Compressor]) -> None:
        if len(stages) < 2:
            raise ValueError("a chain needs at least two stages")
        first, rest = stages[0], list(stages[1:])
        self.lossless = rest.pop() if rest and rest[-1].role == "lossless" else None
        if first.role == "lossless":
            raise ValueError(f"{first.name} is lossless and must be the last stage of a chain")
        if len(rest) > 1:
            raise ValueError(f"a chain takes one value stage after a sparsifier, got {[str(s) for s in rest]}")
        if rest:
            stage = rest[0]
            if first.role != "sparse":
                raise ValueError(f"{stage.name} can only follow a sparsifier (topk, randomk, threshold, dgc), "
                                 f"not {first.name}")
            if stage.role != "dense":
                raise ValueError(f"{stage.name} cannot quantize a sparsifier's values; use a dense quantizer or cast")
        self.first = first
        self.value_stage: Compressor | None = rest[0] if rest else None
        self.stages = list(stages)
        self._config = {}
        self.crc = zlib.crc32(str(self).encode())

    @property
    def summable(self) -> bool:  # type: ignore[override]
        return self.lossless is None and all(s.summable for s in self.stages)

    @property
    def stochastic(self) -> bool:  # type: ignore[override]
        return any(s.stochastic for s in self.stages)

    @property
    def feedback_helps(self) -> bool:  # type: ignore[override]
        return any(s.feedback_helps for s in self.stages)

    def __str__(self) -> str:
        return "+".join(str(s) for s in self.stages)

    def get_config(self) -> dict:
        return {"name": "chain", "stages": [s.get_config() for s in self.stages]}

    @classmethod
    def _from_fields(cls, fields: dict) -> "Chain":
        """The chain of the stages' configs (each whichever compressor it names)."""
        return cls([Compressor.from_config(c) for c in fields.pop("stages")])

    def static_size(self, numel: int, dtype: torch.dtype = torch.float32, shape: tuple[int, ...] | None = None) -> int | None:
        if self.lossless is not None:
            return None
        base = self.first.static_size(numel, dtype, shape)
        if base is None or self.value_stage is None:
            return base
        k = self.first.value_count(numel)  # type: ignore[attr-defined]
        inner = self.value_stage.static_size(k, dtype)
        if inner is None:
            return None
        return base - wire.align(k * dtype.itemsize) + inner

    def encode(self, x: torch.Tensor, ctx: Ctx | None = None) -> Packet:
        return self.encode_sent(x, ctx)[0]

    def encode_sent(self, x: torch.Tensor, ctx: Ctx | None = None) -> tuple[Packet, Iterator[Piece]]:
        """The first stage's pieces; after a value stage, its indices with the decoded values."""
        check_input(str(self), x)
        ctx = ctx if ctx is not None else Ctx()
        if self.value_stage is None:
            p, pieces = self.first.encode_sent(x, ctx)
        else:
            p, idx = self.first.encode_selected(x, ctx)  # type: ignore[attr-defined]
            inner = self.value_stage.encode(p.section(Kind.VALUES), ctx)
            p.sections = [Section(Kind.NESTED, inner.tensor()) if s.kind == Kind.VALUES else s for s in p.sections]
            p._buffer = None
            pieces = self._value_pieces(p, idx, inner)
        if self.lossless is not None:
            p = self.lossless.wrap(p)  # type: ignore[attr-defined]
        p.config = self.crc
        return p.freeze(), pieces

    def _value_pieces(self, p: Packet, idx: torch.Tensor, inner: Packet) -> Iterator[Piece]:
        yield from self.first.pieces(p, idx, self.value_stage._decode(inner))  # type: ignore[attr-defined,union-attr]

    def decode(self, packet: Packet | torch.Tensor, out: torch.Tensor | None = None, *,
               shape: tuple[int, ...] | torch.Size | None = None, dtype: torch.dtype | None = None,
               max_numel: int | None = None) -> torch.Tensor:
        """Outside in: each packet's header and sections are checked against what the receiver
        expects before the stage inside it is unwrapped or decoded."""
        pk = self._unwrap(packet, out, shape, dtype, max_numel)
        return deliver(self.first._decode(pk), pk, out)

    def add_decoded(self, packet: Packet | torch.Tensor, out: torch.Tensor, *,
                    shape: tuple[int, ...] | torch.Size | None = None,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
        pk = self._unwrap(packet, out, shape, dtype, None)
        _add_pieces(out.view(-1), self.first._received(pk))
        return out

    def _unwrap(self, packet: Packet | torch.Tensor, out: torch.Tensor | None,
                shape: tuple[int, ...] | torch.Size | None, dtype: torch.dtype | None,
                max_numel: int | None) -> Packet:
        """The first stage's packet, every stage checked (frame unwrapped, values decoded)."""
        pk = packet if isinstance(packet, Packet) else wire.parse(packet)
        if pk.config != self.crc:
            raise WireFormatError(f"config checksum {pk.config:#010x} does not match {str(self)!r} ({self.crc:#010x}): "
                                  "the sender used a different compressor config")
        check_expected(pk, out, shape, dtype, max_numel)
        inner_config = self.crc
        if self.lossless is not None:
            self.lossless.check_header(pk, out, config=self.crc, shape=pk.shape, dtype=pk.dtype)
            limit, exact = self.content_limit(pk.numel, pk.dtype, len(pk.shape))
            wrapped = self.lossless.unwrap(pk, limit, exact)  # type: ignore[attr-defined]
            if wrapped.dtype != pk.dtype or wrapped.shape != pk.shape:
                raise WireFormatError("a lossless frame's inner packet disagrees with its outer header")
            pk, inner_config = wrapped, self.first.crc
        if self.value_stage is None:
            self.first.check_header(pk, out, config=inner_config, shape=pk.shape, dtype=pk.dtype)
        else:
            pk = self._decode_values(pk, inner_config, out)
        return pk

    def content_limit(self, numel: int, dtype: torch.dtype, ndim: int) -> tuple[int, bool]:
        """(most bytes, whether exactly that many) of the frame content a lossless stage may
        hold for a tensor of `numel` elements: the header and unpadded sections of the largest
        packet the stages before it write. Exact when that packet's size is data-independent."""
        sizes = self.first._section_sizes(numel, dtype)
        exact = sizes is not None
        if sizes is None:
            sizes = self.first.max_section_sizes(numel, dtype)
        if self.value_stage is not None:
            k = self.first.value_count(numel)  # type: ignore[attr-defined]
            inner = self.value_stage.static_size(numel if k is None else k, dtype)
            if inner is None:  # every value stage is a dense codec of static size
                raise TypeError(f"{self.value_stage} has no static packet size")
            exact = exact and k is not None
            sizes = [inner if i == _VALUES_AT else n for i, n in enumerate(sizes)]
        return wire.header_size(ndim, len(sizes)) + sum(sizes), exact

    def _decode_values(self, pk: Packet, config: int, out: torch.Tensor | None) -> Packet:
        """Check the outer packet with a stand-in for its values, then decode the NESTED
        section into the VALUES it encodes (its count fixed by the outer packet)."""
        kinds = pk.kinds()
        if kinds.count(Kind.NESTED) != 1 or len(kinds) <= _VALUES_AT or kinds[_VALUES_AT] != Kind.NESTED:
            raise WireFormatError(f"expected one NESTED section in place of VALUES in a {self} packet, "
                                  f"found {[k.name for k in kinds]}")
        raw = pk.sections[_VALUES_AT].data
        if raw.dtype != torch.uint8:
            raise WireFormatError(f"NESTED section has dtype {raw.dtype}, expected uint8")
        inner = wire.parse(raw)
        if inner.dtype != pk.dtype or len(inner.shape) != 1:
            raise WireFormatError(f"nested values must be a 1-D {pk.dtype} tensor, got {inner.dtype} {inner.shape}")
        # The outer packet, its indices included, is checked with a zero-stride stand-in for
        # the inner count of values (no memory), so a bad outer packet fails before the value
        # stage runs, and the value stage may produce exactly that many values and no more.
        count = inner.numel
        k = self.first.value_count(pk.numel)  # type: ignore[attr-defined]
        if count > pk.numel or (k is not None and count != k):
            raise WireFormatError(f"nested values packet holds {count} elements, expected "
                                  f"{k if k is not None else f'at most {pk.numel}'} for {pk.numel} elements")
        stand_in = torch.zeros((), dtype=pk.dtype, device=raw.device).expand(count)
        probe = Packet(pk.codec, pk.dtype, pk.shape, _with_values(pk.sections, stand_in), pk.config, pk.flags)
        self.first.check_header(probe, out, config=config, shape=pk.shape, dtype=pk.dtype)
        assert self.value_stage is not None
        values = self.value_stage.decode(inner, shape=(count,), dtype=pk.dtype)
        return Packet(pk.codec, pk.dtype, pk.shape, _with_values(pk.sections, values), pk.config, pk.flags)

    def to_summable(self, x: torch.Tensor, ctx: Ctx | None = None) -> torch.Tensor:
        if not self.summable:
            return super().to_summable(x, ctx)
        payload = self.first.to_summable(x, ctx)
        return self.value_stage.to_summable(payload, ctx) if self.value_stage is not None else payload

    def from_summable(self, payload: torch.Tensor, like: torch.Tensor, ctx: Ctx | None = None) -> torch.Tensor:
        if not self.summable:
            return super().from_summable(payload, like, ctx)
        if self.value_stage is not None:
            k = self.first.value_count(like.numel())  # type: ignore[attr-defined]
            payload = self.value_stage.from_summable(payload, torch.empty(k, dtype=like.dtype, device=like.device), ctx)
        return self.first.from_summable(payload, like, ctx)


_VALUES_AT = 1  # a sparsifier's sections: indices, VALUES (, SENTINEL)


def _with_values(sections: list[Section], values: torch.Tensor) -> list[Section]:
    return [Section(Kind.VALUES, values) if i == _VALUES_AT else s for i, s in enumerate(sections)]
