"""Counter-based randomness keyed by (seed, step, rank, key, stream, element).

Every random number is a pure function of its key and element index, so the CPU
reference and the CUDA kernels produce the same bits, and stochastic compressors are
reproducible. The per-call key is mixed on the host with splitmix64; the per-element
hash is a two-round xorshift-multiply over uint32 (constants from the lowbias32 family),
evaluated here with in-place int32 torch ops (wrapping multiply, masked logical shift)::

    x = (element + k0) mod 2**32
    x ^= x >> 16;  x *= 0x21F0AAAD   (mod 2**32)
    x ^= x >> 15;  x *= 0x735A2D97   (mod 2**32)
    x ^= x >> 15;  x ^= k1
    u24 = x >> 8                      (a uniform integer in [0, 2**24))

A CUDA kernel reproduces it with `uint32_t` arithmetic; `reference_bits24` is the same
recipe in pure Python (the executable spec the tests compare against).

Speed (CPU): the hash is ~15 elementwise passes. Over a whole 100 MB stream each pass is
bound by memory bandwidth, so large requests are evaluated in cache-sized blocks of
`BLOCK` elements that all passes run over before moving on, with one reused scratch
block; `out=` lets a caller fill its own (reused) buffer. The bits are identical for any
block size: every element only depends on its own index.
"""

from __future__ import annotations

import torch

_M64 = (1 << 64) - 1
_M1 = 0x21F0AAAD
_M2 = 0x735A2D97

#: Elements hashed per pass on the CPU (2 MiB of int32: stays in the L2/L3 cache).
BLOCK = 1 << 19


def splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def stream_key(seed: int, step: int, rank: int, key: int, stream: int) -> tuple[int, int]:
    """Two 32-bit words that select one random stream; any field change gives another."""
    z = 0
    for part in (seed, step, rank, key, stream):
        z = splitmix64(z ^ (part & _M64))
    return z & 0xFFFFFFFF, z >> 32


def reference_bits24(key: tuple[int, int], element: int) -> int:
    """The u24 of one element in plain Python integers (slow; the spec for tests/kernels)."""
    k0, k1 = key
    m = 0xFFFFFFFF
    x = (element + k0) & m
    x ^= x >> 16
    x = (x * _M1) & m
    x ^= x >> 15
    x = (x * _M2) & m
    x ^= x >> 15
    x ^= k1 & m
    return x >> 8


def _signed(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def hash_u32(words: torch.Tensor, k1: int, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Mix int32 words (element + k0, already added) in place; returns the same tensor.

    `scratch`, if given, is an int32 tensor of the same size used as the temporary.
    """
    x = words
    t = torch.empty_like(x) if scratch is None else scratch
    for shift, mult in ((16, _M1), (15, _M2)):
        torch.bitwise_right_shift(x, shift, out=t)
        t.bitwise_and_((1 << (32 - shift)) - 1)  # arithmetic shift + mask = logical shift
        x.bitwise_xor_(t).mul_(_signed(mult))
    torch.bitwise_right_shift(x, 15, out=t)
    t.bitwise_and_((1 << 17) - 1)
    x.bitwise_xor_(t).bitwise_xor_(_signed(k1))
    return x


def _check_range(n: int, start: int) -> None:
    if n < 0 or start < 0:
        raise ValueError(f"bad random range: n={n}, start={start}")
    if start + n > 1 << 32:
        raise ValueError("random streams address at most 2**32 elements")


def _block_size(n: int, device: torch.device) -> int:
    # Blocking pays on the CPU (cache); a GPU runs the whole stream in one pass per op.
    return max(1, n) if device.type != "cpu" else max(1, min(n, BLOCK))


_BASES: dict[torch.device, torch.Tensor] = {}


def _arange(block: int, device: torch.device) -> torch.Tensor:
    """0..block-1 as int32, cached per device (read-only; replaced by a longer one when needed)."""
    base = _BASES.get(device)
    if base is None or base.numel() < block:
        base = torch.arange(block, dtype=torch.int32, device=device)
        if block <= BLOCK:  # cache only block-sized ones (a GPU stream is one big block)
            _BASES[device] = base
    return base


def _fill(key: tuple[int, int], x: torch.Tensor, start: int, base: torch.Tensor, tmp: torch.Tensor) -> None:
    """x (int32, contiguous) <- u24 of elements start..start+len(x)-1; base = arange scratch."""
    m = x.numel()
    torch.add(base[:m], _signed(key[0] + start), out=x)  # wraps mod 2**32 like the kernel
    hash_u32(x, key[1], tmp[:m])
    x.bitwise_right_shift_(8).bitwise_and_((1 << 24) - 1)


def _out(out: torch.Tensor | None, n: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    if out is None:
        return torch.empty(n, dtype=dtype, device=device)
    if out.dtype != dtype or out.numel() != n or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of {n} elements, "
                         f"got {out.dtype} with shape {tuple(out.shape)}")
    return out.view(-1)


def bits24(key: tuple[int, int], n: int, device: torch.device | str = "cpu", start: int = 0,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Uniform integers in [0, 2**24) for elements start..start+n-1, as int32.

    With `out` (a contiguous int32 tensor of n elements) the result is written there
    and `device` is taken from it.
    """
    _check_range(n, start)
    dev = torch.device(device) if out is None else out.device
    res = _out(out, n, torch.int32, dev)
    block = _block_size(n, dev)
    base = _arange(block, dev)
    tmp = torch.empty(block, dtype=torch.int32, device=dev)
    for s in range(0, n, block):
        _fill(key, res[s: s + block], start + s, base, tmp)
    return res


def uniform(key: tuple[int, int], n: int, device: torch.device | str = "cpu", start: int = 0,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 uniforms in [0, 1) with 24-bit resolution (exactly representable): u24 * 2**-24.

    With `out` (a contiguous float32 tensor of n elements) the result is written there.
    """
    _check_range(n, start)
    dev = torch.device(device) if out is None else out.device
    res = _out(out, n, torch.float32, dev)
    block = _block_size(n, dev)
    base = _arange(block, dev)
    tmp = torch.empty(block, dtype=torch.int32, device=dev)
    ints = torch.empty(block, dtype=torch.int32, device=dev)
    for s in range(0, n, block):
        dst = res[s: s + block]
        x = ints[: dst.numel()]
        _fill(key, x, start + s, base, tmp)
        dst.copy_(x).mul_(2.0 ** -24)
    return res


def randbelow(key: tuple[int, int], bounds: torch.Tensor) -> torch.Tensor:
    """For each element j a uniform integer in [0, bounds[j]) (bounds < 2**24), int64.

    Computed as floor(u24 * bound / 2**24): exact in int64 and identical on CUDA.
    """
    u = bits24(key, bounds.numel(), bounds.device).to(torch.int64)
    return u.mul_(bounds.to(torch.int64)).bitwise_right_shift_(24)
