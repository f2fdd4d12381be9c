"""The compressor contract: encode a tensor into a Packet, decode a packet back.

Each algorithm is one small subclass with an immutable config declared as `Param`s,
so specs, configs and wire checks all come from one declaration.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator

import torch

from ..errors import WireFormatError
from . import names, wire
from .finite import parts_finite
from .wire import FLOAT_DTYPES, Kind, Packet, Section


@dataclass(frozen=True)
class Ctx:
    """Everything randomness may depend on: the same Ctx gives the same bytes."""

    seed: int = 0
    step: int = 0
    rank: int = 0
    key: int | str = 0  # a string (a bucket or parameter name) is hashed with `key_of`

    def __post_init__(self) -> None:
        for name in ("seed", "step", "rank", "key"):
            value = getattr(self, name)
            if name == "key" and isinstance(value, str):
                object.__setattr__(self, name, self.key_of(value))
                continue
            try:  # numpy and torch integer scalars become plain ints
                if isinstance(value, bool):
                    raise TypeError
                object.__setattr__(self, name, int(value.__index__()))
            except (AttributeError, TypeError):
                kinds = "an int or a str" if name == "key" else "an int"
                raise TypeError(f"Ctx.{name} must be {kinds}, got {type(value).__name__} {value!r}") from None

    @staticmethod
    def key_of(name: str) -> int:
        """A stable integer key for a bucket or parameter name (same on every rank)."""
        return zlib.crc32(name.encode())


#: Part of a decoded tensor: (positions in the flat tensor, their decoded values); positions
#: are a slice or ascending int64 indices, and every element no piece covers decodes to +0.
Piece = tuple["slice | torch.Tensor", torch.Tensor]


@dataclass(frozen=True)
class Param:
    """One config field: its type, default and the check a value must pass."""

    name: str
    type: type
    default: Any
    check: Callable[[Any], bool] | None = None
    rule: str = ""

    def coerce(self, owner: str, value: Any) -> Any:
        try:
            if self.type is bool and isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                value = value.lower() in ("true", "1")
            elif self.type is int and isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            elif value is not None or self.default is not None:
                value = self.type(value)
        except (TypeError, ValueError):
            raise ValueError(f"{owner}: {self.name}={value!r} is not a valid {self.type.__name__}") from None
        if self.type is float and value is not None and not math.isfinite(value):
            raise ValueError(f"{owner}: {self.name}={value!r} must be finite")
        if self.check is not None and value is not None and not self.check(value):
            raise ValueError(f"{owner}: {self.name}={value!r} is out of range ({self.rule})")
        return value


class Compressor:
    """Base of every compressor; subclasses set the class attributes and the two hooks.

    Subclasses implement `_encode(flat, ctx) -> list[Section]` over a contiguous 1-D
    tensor and `_decode(packet) -> flat tensor` after `_check` has validated the
    sections' kinds, dtypes and lengths against the header and the config.
    """

    name: ClassVar[str]
    codec_id: ClassVar[int]
    params: ClassVar[tuple[Param, ...]] = ()
    summable: ClassVar[bool] = False  # payloads may be summed element-wise (allreduce)
    stochastic: ClassVar[bool] = False  # output depends on Ctx
    role: ClassVar[str] = "dense"  # "dense", "sparse" or "lossless": where it may sit in a chain
    # error_feedback="auto" turns error feedback on: the compressor is biased enough for the
    # residual to matter (sparsifiers, sign/onebit, fp8/int8), not a near-lossless cast or
    # an unbiased estimator (randomk, qsgd, terngrad), whose residuals only add variance
    feedback_helps: ClassVar[bool] = True
    # the k largest magnitudes of the whole tensor, as `select.topk` picks them: what the strategies
    # that select from the sum over ranks (oktopk, artopk) reproduce (chunked top-k is not)
    selects_global_topk: bool = False
    flag_bits: ClassVar[int] = 0  # header flag bits this codec defines; any other set bit is rejected

    def __init__(self, **kwargs: Any) -> None:
        known = {p.name: p for p in self.params}
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            valid = ", ".join(known) or "none"
            raise ValueError(f"{self.name}: unknown parameter(s) {', '.join(unknown)}; valid: {valid}")
        cfg = {p.name: p.coerce(self.name, kwargs.get(p.name, p.default)) for p in self.params}
        self._config: dict[str, Any] = cfg
        self._validate()
        self.crc = zlib.crc32(str(self).encode())

    def _validate(self) -> None:
        """Cross-parameter checks; raise ValueError."""

    def __getattr__(self, item: str) -> Any:
        cfg = self.__dict__.get("_config")
        if cfg is not None and item in cfg:
            return cfg[item]
        raise AttributeError(f"{type(self).__name__} has no attribute {item!r}")

    # ---- config -------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, **self._config}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Compressor":
        """Inverse of `get_config()`. On a compressor's class, that compressor (a config naming
        another one raises ValueError); on `Compressor` itself or an abstract base (no
        `name`), whichever registered subclass (or chain) the config names."""
        if not isinstance(config, dict) or "name" not in config:
            raise ValueError(f"a compressor config is a dict with a 'name', got {config!r}")
        fields = dict(config)
        name = fields.pop("name")
        own = getattr(cls, "name", None)
        if own is None:
            named = names.config_class(name)
            if not issubclass(named, cls):
                raise ValueError(f"{cls.__name__}.from_config: {name!r} is not a {cls.__name__}")
            return named.from_config(config)
        if name != own:
            raise ValueError(f"{cls.__name__}.from_config: the config names {name!r}, not {own!r}")
        return cls._from_fields(fields)

    @classmethod
    def _from_fields(cls, fields: dict[str, Any]) -> "Compressor":
        """This class from a config's fields (its "name" already checked)."""
        return cls(**fields)

    def __str__(self) -> str:
        args = [f"{p.name}={_fmt(self._config[p.name])}" for p in self.params
                if self._config[p.name] != p.default]
        return self.name + (":" + ",".join(args) if args else "")

    def __repr__(self) -> str:
        return f"gradwire.compressor({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Compressor) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    # ---- sizes --------------------------------------------------------------------
    def static_size(self, numel: int, dtype: torch.dtype = torch.float32, shape: tuple[int, ...] | None = None) -> int | None:
        """Packet bytes when known from numel and dtype alone, else None."""
        sizes = self._section_sizes(numel, dtype)
        if sizes is None:
            return None
        ndim = 1 if shape is None else len(shape)
        return wire.header_size(ndim, len(sizes)) + sum(wire.align(s) for s in sizes)

    def _section_sizes(self, numel: int, dtype: torch.dtype) -> list[int] | None:
        return None

    def max_section_sizes(self, numel: int, dtype: torch.dtype) -> list[int]:
        """Unpadded bytes of each section of the largest packet this compressor writes for
        `numel` elements (bounds a lossless frame's content before it is decompressed)."""
        sizes = self._section_sizes(numel, dtype)
        if sizes is None:
            raise NotImplementedError(f"{self.name} declares no size bound")
        return sizes

    # ---- encode / decode ----------------------------------------------------------
    def encode(self, x: torch.Tensor, ctx: Ctx | None = None) -> Packet:
        check_input(self.name, x)
        flat = x.detach().reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        sections = self._encode(flat, ctx if ctx is not None else Ctx())
        return Packet(self.codec_id, x.dtype, tuple(x.shape), sections, self.crc).freeze()

    def encode_sent(self, x: torch.Tensor, ctx: Ctx | None = None) -> tuple[Packet, Iterator[Piece]]:
        """encode(x), plus what the packet decodes to as pieces (see `Piece`), made lazily.

        Error feedback and DGC update their state from the pieces in place: a dense decode
        would be a fresh full-size tensor, which costs more than the arithmetic on the CPU."""
        packet = self.encode(x, ctx)
        return packet, self._sent(packet)

    def encode_residual(self, x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor,
                        ctx: Ctx | None = None) -> tuple[Packet, torch.Tensor]:
        """Error feedback's step: ``out = x + residual`` (x when None), encode out, then
        subtract in place what the packet decodes to, so out becomes the new residual.
        Returns the packet and a 0-d bool tensor: whether that residual is all finite.
        Quantizers and casts fuse all of it into their tiles; the default applies the
        pieces of `encode_sent`. `out` is contiguous, shaped like x.

        Only the pieces' positions are checked: elsewhere the residual is the input, and a
        non-finite input element decodes non-finite somewhere (the rule every compressor
        keeps for AMP), which makes the residual there non-finite too."""
        if residual is None:
            out.copy_(x)
        else:
            torch.add(x, residual, out=out)
        packet, pieces = self.encode_sent(out, ctx)
        flat = out.view(-1)
        sums, parts = [], []
        for where, values in pieces:
            if isinstance(where, slice):
                part = flat[where].sub_(values)
            else:
                part = flat.index_select(0, where).sub_(values)
                flat.index_copy_(0, where, part)
            if part.device.type == "cpu":
                sums.append(part.sum())
            parts.append(part)
        return packet, parts_finite(sums, parts)

    def _sent(self, pk: Packet) -> Iterator[Piece]:
        """The pieces of the sender's own packet (no validation); default: one dense decode."""
        yield slice(0, pk.numel), self._decode(pk)

    def decode(self, packet: Packet | torch.Tensor, out: torch.Tensor | None = None, *,
               shape: tuple[int, ...] | torch.Size | None = None, dtype: torch.dtype | None = None,
               max_numel: int | None = None) -> torch.Tensor:
        """Validate, then rebuild the tensor. Without `out` the result may share the
        packet's memory (the `none` codec returns a view), so copy before mutating it.

        A receiver says what it expects -- `out`, or `shape` and `dtype` of its own tensor --
        and a packet that disagrees raises `WireFormatError` before anything is allocated.
        Given neither `out` nor `shape`, the packet may declare at most `max_numel` elements
        (default `wire.MAX_DECODE_NUMEL`, 2**28)."""
        pk = packet if isinstance(packet, Packet) else wire.parse(packet)
        self.check_header(pk, out, shape=shape, dtype=dtype, max_numel=max_numel)
        flat = self._decode(pk)
        return deliver(flat, pk, out)

    def add_decoded(self, packet: Packet | torch.Tensor, out: torch.Tensor, *,
                    shape: tuple[int, ...] | torch.Size | None = None,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
        """out += decode(packet), bit for bit, after the same validation as `decode`, but
        without a full-size decoded tensor where the codec allows (sparse: only the sent
        positions; quantizers: tile by tile). For summing packets from many ranks."""
        pk = packet if isinstance(packet, Packet) else wire.parse(packet)
        self.check_header(pk, out, shape=shape, dtype=dtype)
        _add_pieces(out.view(-1), self._received(pk))
        return out

    def _received(self, pk: Packet) -> Iterator[Piece]:
        """The pieces of a validated packet (default: those of the sender's own)."""
        return self._sent(pk)

    def check_header(self, pk: Packet, out: torch.Tensor | None, config: int | None = None, *,
                     shape: tuple[int, ...] | torch.Size | None = None, dtype: torch.dtype | None = None,
                     max_numel: int | None = None) -> None:
        """Codec, config, flags, expected size and dtype, and section checks before any allocation."""
        if pk.codec != self.codec_id:
            raise WireFormatError(f"codec id {pk.codec} is not {self.name}'s ({self.codec_id})")
        want = self.crc if config is None else config
        if pk.config != want:
            raise WireFormatError(f"config checksum {pk.config:#010x} does not match {str(self)!r} ({want:#010x}): "
                                  "the sender used a different compressor config")
        if pk.flags & ~self.flag_bits:
            raise WireFormatError(f"{self.name} packet has unknown flag bits {pk.flags & ~self.flag_bits:#04x}")
        check_expected(pk, out, shape, dtype, max_numel)
        self._check(pk)

    def _check(self, pk: Packet) -> None:
        raise NotImplementedError

    def _encode(self, flat: torch.Tensor, ctx: Ctx) -> list[Section]:
        raise NotImplementedError

    def _decode(self, pk: Packet) -> torch.Tensor:
        raise NotImplementedError

    # ---- summable payloads (allreduce) ----------------------------------------------
    def to_summable(self, x: torch.Tensor, ctx: Ctx | None = None) -> torch.Tensor:
        """A typed tensor whose element-wise sum over ranks decodes to the sum of inputs."""
        raise TypeError(f"{self.name} payloads are not summable; exchange packets by allgather")

    def from_summable(self, payload: torch.Tensor, like: torch.Tensor, ctx: Ctx | None = None) -> torch.Tensor:
        raise TypeError(f"{self.name} payloads are not summable; exchange packets by allgather")


def _add_pieces(flat: torch.Tensor, pieces: Iterator[Piece]) -> None:
    for where, values in pieces:
        if isinstance(where, slice):
            flat[where].add_(values)
        else:
            flat.index_copy_(0, where, flat.index_select(0, where).add_(values))


def check_input(name: str, x: Any) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: tensor dtype {x.dtype} is not supported; use one of float32, float16, bfloat16")
    if x.dim() > wire.MAX_NDIM:
        raise ValueError(f"{name}: tensors of more than {wire.MAX_NDIM} dimensions are not supported")
    if x.is_cuda:
        from ..cuda import require_cupy

        require_cupy()


def check_expected(pk: Packet, out: torch.Tensor | None, shape: tuple[int, ...] | torch.Size | None,
                   dtype: torch.dtype | None, max_numel: int | None) -> None:
    """The packet against what the receiver expects (raises WireFormatError, allocates nothing).

    `out`: numel and dtype must match (then `out` bounds the size); `shape`/`dtype`: must
    match exactly; with neither `out` nor `shape` the numel is capped at `max_numel`."""
    if pk.dtype not in FLOAT_DTYPES:
        raise WireFormatError(f"tensor dtype {pk.dtype} is not one of {FLOAT_DTYPES}")
    if dtype is not None and pk.dtype != dtype:
        raise WireFormatError(f"packet holds {pk.dtype} but the receiver expects {dtype}")
    if shape is not None and pk.shape != tuple(shape):
        raise WireFormatError(f"packet has shape {pk.shape} but the receiver expects {tuple(shape)}")
    if out is not None:
        if out.numel() != pk.numel:
            raise WireFormatError(f"packet holds {pk.numel} elements but out has {out.numel()}")
        if out.dtype != pk.dtype:
            raise WireFormatError(f"packet holds {pk.dtype} but out is {out.dtype}")
    elif shape is None:
        cap = wire.MAX_DECODE_NUMEL if max_numel is None else max_numel
        if pk.numel > cap:
            raise WireFormatError(f"numel {pk.numel} exceeds the decode limit {cap}; "
                                  "pass out=, shape= or max_numel= to allow it")


def expect(pk: Packet, *spec: tuple[Kind, torch.dtype | tuple[torch.dtype, ...], int | None]) -> list[torch.Tensor]:
    """Check a packet has exactly these sections: (kind, dtype(s), element count or None)."""
    if len(pk.sections) != len(spec):
        want = ", ".join(k.name for k, _, _ in spec)
        got = ", ".join(s.kind.name for s in pk.sections)
        raise WireFormatError(f"expected sections [{want}], packet has [{got}]")
    out = []
    for sec, (kind, dtypes, count) in zip(pk.sections, spec):
        if sec.kind != kind:
            raise WireFormatError(f"expected a {kind.name} section, found {sec.kind.name}")
        allowed = dtypes if isinstance(dtypes, tuple) else (dtypes,)
        if sec.data.dtype not in allowed:
            raise WireFormatError(f"{kind.name} section has dtype {sec.data.dtype}, expected {allowed}")
        if count is not None and sec.data.numel() != count:
            raise WireFormatError(f"{kind.name} section has {sec.data.numel()} elements, expected {count}")
        out.append(sec.data)
    return out


def deliver(flat: torch.Tensor, pk: Packet, out: torch.Tensor | None) -> torch.Tensor:
    result = flat.reshape(pk.shape)
    if out is None:
        return result
    out.copy_(result.reshape(out.shape))
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)
