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

A CUDA kernel reproduces it with `uint32_t` arithmetic.
"""

from __future__ import annotations

import torch

_M64 = (1 << 64) - 1
_M1 = 0x21F0AAAD
_M2 = 0x735A2D97


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


def _signed(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def hash_u32(words: torch.Tensor, k1: int) -> torch.Tensor:
    """Mix int32 words (element + k0, already added) in place; returns the same tensor."""
    x = words
    t = torch.empty_like(x)
    for shift, mult in ((16, _M1), (15, _M2)):
        torch.bitwise_right_shift(x, shift, out=t)
        t.bitwise_and_((1 << (32 - shift)) - 1)
        x.bitwise_xor_(t).mul_(_signed(mult))
    torch.bitwise_right_shift(x, 15, out=t)
    t.bitwise_and_((1 << 17) - 1)
    x.bitwise_xor_(t).bitwise_xor_(_signed(k1))
    return x


def bits24(key: tuple[int, int], n: int, device: torch.device | str = "cpu", start: int = 0) -> torch.Tensor:
    """Uniform integers in [0, 2**24) for elements start..start+n-1, as int32."""
    if start + n > 1 << 32:
        raise ValueError("random streams address at most 2**32 elements")
    k0, k1 = key
    x = torch.arange(n, dtype=torch.int32, device=device)
    x.add_(_signed(k0 + start))
    hash_u32(x, k1)
    x.bitwise_right_shift_(8).bitwise_and_((1 << 24) - 1)
    return x


def uniform(key: tuple[int, int], n: int, device: torch.device | str = "cpu", start: int = 0) -> torch.Tensor:
    """float32 uniforms in [0, 1) with 24-bit resolution (exactly representable)."""
    return bits24(key, n, device, start).to(torch.float32).mul_(2.0 ** -24)


def randbelow(key: tuple[int, int], bounds: torch.Tensor) -> torch.Tensor:
    """For each element j a uniform integer in [0, bounds[j]) (bounds < 2**24), int64.

    Computed as floor(u24 * bound / 2**24): exact in int64 and identical on CUDA.
    """
    u = bits24(key, bounds.numel(), bounds.device).to(torch.int64)
    return u.mul_(bounds.to(torch.int64)).bitwise_right_shift_(24)
