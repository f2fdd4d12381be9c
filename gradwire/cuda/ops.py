"""One function per kernel operation: torch tensors in, torch tensors out.

These are the CUDA rows of the primitive-op table that compressors call for CUDA tensors
(gradwire/compress/* keep the CPU reference). Shapes and launch configurations live
here; arithmetic lives in `kernels/*.cu`. Nothing here synchronizes with the host except
where a size depends on the data (`at_least`, `dgc`: one 8-byte copy of a count), which
the docstring says.
"""

from __future__ import annotations

import numpy as np
import torch

from . import launch

THREADS = 256
TILE = 256 * 16  # elements per block in select_count / select_write (GW_TILE)
_DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

# reduction ops and per-chunk derivations (elementwise.cu)
OP_ABSMAX, OP_MINMAX, OP_ABSSUM, OP_SQSUM, OP_PN = range(5)
FP4_MAX = 6.0  # e2m1's largest magnitude: fp4 shares fp8's per-chunk derivation (FIN_FP8) with it
FIN_FP8, FIN_INT8, FIN_QSGD, FIN_TERN, FIN_SIGN, FIN_ONEBIT, FIN_SENTINEL = range(7)
_OP_OF = {FIN_FP8: OP_ABSMAX, FIN_INT8: OP_MINMAX, FIN_QSGD: OP_SQSUM, FIN_TERN: OP_ABSMAX,
          FIN_SIGN: OP_ABSSUM, FIN_ONEBIT: OP_PN, FIN_SENTINEL: OP_MINMAX}


def _i64(v: int) -> np.int64:
    return np.int64(v)


def _launch(file: str, name: str, device: torch.device, work: int, args: tuple, block: int = THREADS,
            grid: int | None = None) -> None:
    """Launch `name` over `work` items (grid-stride kernels: the grid is capped), through the
    current launcher (CuPy on a GPU, or the CPU emulator: gradwire/cuda/launch.py)."""
    launcher = launch.current()
    if grid is None:
        grid = max(1, min(-(-work // block), launcher.max_blocks(device)))
    launcher.launch(file, name, grid, block, args)


def on_torch_stream(device: torch.device):
    """Launches inside are ordered on torch's current stream of `device` (GPU), or run now (emulator)."""
    return launch.current().stream(device)


def _empty(n: int, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(n, dtype=dtype, device=like.device)


# ---- casts ------------------------------------------------------------------------------
def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (1-D fp32/fp16/bf16) in another float dtype, rounding like torch's CPU casts (NaN bits included)."""
    if x.dtype == dtype:
        return x.clone()
    y = _empty(x.numel(), dtype, x)
    if x.numel():
        with on_torch_stream(x.device):
            _launch("elementwise.cu", f"cast_kernel<{_DT[x.dtype]}, {_DT[dtype]}>", x.device, x.numel(),
                    (x, y, _i64(x.numel())))
    return y


# ---- per-chunk statistics ------------------------------------------------------------------
def chunk_stats(x: torch.Tensor, chunk: int, fin: int, param: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scales, f0, f1) of each chunk of x (see seg_finish in elementwise.cu).

    A chunk is cut into segments of at most 4096 elements (one warp each; at most 1024 of
    them per chunk), whose partials one thread per chunk merges in order: deterministic.
    """
    n = x.numel()
    per = 2 if fin == FIN_ONEBIT else 1
    nch = -(-n // chunk)
    scales = _empty(per * nch if fin != FIN_SENTINEL else 1, torch.float32, x)
    f0, f1 = _empty(nch, torch.float32, x), _empty(nch, torch.float32, x)
    _stats(x, chunk, fin, param, scales, f0, f1, None)
    return scales, f0, f1


def _stats(x: torch.Tensor, chunk: int, fin: int, param: float, scales: torch.Tensor, f0: torch.Tensor,
           f1: torch.Tensor, corrected: tuple | None) -> None:
    """`chunk_stats` into given outputs; `corrected` = (e, add, out): of x + e instead of x
    (feedback.cu's `ef_seg_reduce`, which also writes x + e into out)."""
    n = x.numel()
    nch = -(-n // chunk)
    seg = max(min(chunk, 4096), -(-chunk // 1024))
    spc = -(-chunk // seg)
    nseg = nch * spc
    pa, pb = _empty(nseg, torch.float32, x), _empty(nseg, torch.float32, x)
    pc = _empty(nseg, torch.int32, x)
    dt, op = _DT[x.dtype], _OP_OF[fin]
    geometry = (_i64(n), _i64(chunk), _i64(seg), _i64(spc), _i64(nseg), pa, pb, pc)
    with on_torch_stream(x.device):
        if corrected is None:
            _launch("elementwise.cu", f"seg_reduce<{dt}, {op}>", x.device, 32 * nseg, (x,) + geometry)
        else:
            _launch("feedback.cu", f"ef_seg_reduce<{dt}, {op}>", x.device, 32 * nseg, (x,) + corrected + geometry)
        _launch("elementwise.cu", f"seg_finish<{op}, {fin}>", x.device, nch,
                (pa, pb, pc, _i64(nch), _i64(spc), _i64(n), _i64(chunk), np.float32(param), scales, f0, f1))


def _groups(n: int) -> int:
    return -(-n // 8)


# ---- fp8 / fp4 / int8 ----------------------------------------------------------------------------
def fp8_encode(x: torch.Tensor, chunk: int, e5m2: bool, fmax: float, code_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.numel()
    scales, f0, _ = chunk_stats(x, chunk, FIN_FP8, fmax)
    codes = _empty(n, code_dtype, x)
    with on_torch_stream(x.device):
        _launch("elementwise.cu", f"fp8_encode<{_DT[x.dtype]}, {int(e5m2)}>", x.device, _groups(n),
                (x, _i64(n), _i64(chunk), f0, codes))
    return scales, codes


def fp8_decode(codes: torch.Tensor, scales: torch.Tensor, chunk: int, e5m2: bool, dtype: torch.dtype) -> torch.Tensor:
    n = codes.numel()
    y = _empty(n, dtype, codes)
    if n:
        with on_torch_stream(codes.device):
            _launch("elementwise.cu", f"fp8_decode<{_DT[dtype]}, {int(e5m2)}>", codes.device, n,
                    (codes, scales, _i64(n), _i64(chunk), y))
    return y


def fp4_encode(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, packed e2m1 codes: 4 bytes per group of 8 elements)."""
    n = x.numel()
    scales, f0, _ = chunk_stats(x, chunk, FIN_FP8, FP4_MAX)
    data = _empty(4 * _groups(n), torch.uint8, x)
    with on_torch_stream(x.device):
        _launch("elementwise.cu", f"fp4_encode<{_DT[x.dtype]}>", x.device, _groups(n), (x, _i64(n), _i64(chunk), f0, data))
    return scales, data


def fp4_decode(data: torch.Tensor, scales: torch.Tensor, n: int, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    y = _empty(n, dtype, data)
    if n:
        with on_torch_stream(data.device):
            _launch("elementwise.cu", f"fp4_decode<{_DT[dtype]}>", data.device, n,
                    (data, scales, _i64(n), _i64(chunk), y))
    return y


def int8_encode(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = x.numel()
    scales, inv, offsets = chunk_stats(x, chunk, FIN_INT8)
    codes = _empty(n, torch.uint8, x)
    with on_torch_stream(x.device):
        _launch("elementwise.cu", f"int8_encode<{_DT[x.dtype]}>", x.device, _groups(n),
                (x, _i64(n), _i64(chunk), inv, offsets, codes))
    return scales, offsets, codes


def int8_decode(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, chunk: int,
                dtype: torch.dtype) -> torch.Tensor:
    n = codes.numel()
    y = _empty(n, dtype, codes)
    if n:
        with on_torch_stream(codes.device):
            _launch("elementwise.cu", f"int8_decode<{_DT[dtype]}>", codes.device, n,
                    (codes, scales, offsets, _i64(n), _i64(chunk), y))
    return y


# ---- qsgd / terngrad -----------------------------------------------------------------------
def stochastic_encode(x: torch.Tensor, chunk: int, levels: int, bits: int, key: tuple[int, int],
                      norm: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scales, sign bits, packed levels): qsgd (norm=True: L2 norms) or terngrad (max |x|).
    `chunk` = numel for one scale over the whole tensor."""
    n = x.numel()
    scales, f0, _ = chunk_stats(x, chunk, FIN_QSGD if norm else FIN_TERN, float(levels))
    g = _groups(n)
    signs = _empty(g, torch.uint8, x)
    packed = _empty(bits * g, torch.uint8, x)
    with on_torch_stream(x.device):
        _launch("elementwise.cu", f"stochastic_encode<{_DT[x.dtype]}>", x.device, g,
                (x, _i64(n), _i64(chunk), f0, np.float32(levels), np.int32(bits),
                 np.uint32(key[0]), np.uint32(key[1]), signs, packed))
    return scales, signs, packed


def stochastic_decode(signs: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int, chunk: int,
                      levels: int, bits: int, dtype: torch.dtype) -> torch.Tensor:
    y = _empty(n, dtype, signs)
    if n:
        with on_torch_stream(signs.device):
            _launch("elementwise.cu", f"stochastic_decode<{_DT[dtype]}>", signs.device, n,
                    (signs, packed, scales, _i64(n), _i64(chunk), np.float32(levels), np.int32(bits), y))
    return y


# ---- sign / onebit -------------------------------------------------------------------------
def sign_encode(x: torch.Tensor, chunk: int, two_means: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, sign bits): sign's mean |x| per chunk, or onebit's (mean of x >= 0, mean of x < 0) pairs."""
    n = x.numel()
    scales, _, _ = chunk_stats(x, chunk, FIN_ONEBIT if two_means else FIN_SIGN)
    bits = _empty(_groups(n), torch.uint8, x)
    with on_torch_stream(x.device):
        _launch("elementwise.cu", f"sign_bits<{_DT[x.dtype]}>", x.device, _groups(n), (x, _i64(n), bits))
    return scales, bits


def sign_decode(bits: torch.Tensor, scales: torch.Tensor, n: int, chunk: int, two_means: bool,
                dtype: torch.dtype) -> torch.Tensor:
    y = _empty(n, dtype, bits)
    if n:
        name = "onebit_decode" if two_means else "sign_decode"
        with on_torch_stream(bits.device):
            _launch("elementwise.cu", f"{name}<{_DT[dtype]}>", bits.device, n, (bits, scales, _i64(n), _i64(chunk), y))
    return y


# ---- error feedback and DGC momentum (feedback.cu) -----------------------------------------
# Each `ef_*` takes x, the residual e (None on the first step) and out (x's shape, contiguous):
# out = x + e, the packet's sections are written in place, out becomes x + e - decode(packet).
# They return `bad` (int32[1]): 1 when the new residual holds a NaN/Inf (`ok` turns it into
# the flag `_keep` takes). Only per-chunk scratch is allocated, never a full-size tensor.
def _flag(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=x.device)


def ok(bad: torch.Tensor) -> torch.Tensor:
    """0-d bool on the device: the step's new state is all finite (no host sync)."""
    return torch.eq(bad[0], 0)


def _corr(x: torch.Tensor, e: torch.Tensor | None) -> tuple:
    return (x, x if e is None else e, np.int32(e is not None))


def ef_cast(x: torch.Tensor, e: torch.Tensor | None, out: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """data = cast(x + e) (same dtype: a copy), out = x + e - widen(data), in one pass."""
    bad, n = _flag(x), x.numel()
    with on_torch_stream(x.device):
        _launch("feedback.cu", f"ef_cast<{_DT[x.dtype]}, {_DT[data.dtype]}>", x.device, n,
                _corr(x, e) + (_i64(n), data, out, bad))
    return bad


def _ef_chunked(x: torch.Tensor, e: torch.Tensor | None, out: torch.Tensor, chunk: int, fin: int, param: float,
                scales: torch.Tensor, f1: torch.Tensor | None, name: str, args: tuple) -> torch.Tensor:
    """Statistics of x + e (written to out), then `name` (args after out, n, chunk) fused."""
    n = x.numel()
    nch = -(-n // chunk)
    f0 = _empty(nch, torch.float32, x)
    _stats(x, chunk, fin, param, scales, f0, f1 if f1 is not None else _empty(nch, torch.float32, x),
           _corr(x, e)[1:] + (out,))
    bad = _flag(x)
    with on_torch_stream(x.device):
        _launch("feedback.cu", name, x.device, _groups(n),
                (out, _i64(n), _i64(chunk)) + tuple(f0 if a is None else a for a in args) + (bad,))
    return bad


def ef_fp8(x: torch.Tensor, e: torch.Tensor | None, out: torch.Tensor, chunk: int, e5m2: bool, fmax: float,
           scales: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    return _ef_chunked(x, e, out, chunk, FIN_FP8, fmax, scales, None,
                       f"ef_fp8<{_DT[x.dtype]}, {int(e5m2)}>", (None, scales, codes.view(torch.uint8)))


def ef_fp4(x: torch.Tensor, e: torch.Tensor | None, out: torch.Tensor, chunk: int, scales: torch.Tensor,
           data: torch.Tensor) -> torch.Tensor:
    return _ef_chunked(x, e, out, chunk, FIN_FP8, FP4_MAX, scales, None, f"ef_fp4<{_DT[x.dtype]}>", (None, scales, data))


def ef_int8(x: torch.Tensor, e: torch.Tensor | None, out: torch.Tensor, chunk: int, scales: torch.Tensor,
            offsets: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    return _ef_chunked(x, e, out, chunk, FIN_INT8, 0.0, scales, offsets,
                       f"ef_int8<{_DT[x.dtype]}>", (None, offsets, scales, codes))


def ef_stochastic(x: torch.Tensor, e: torch.Tensor | None, out: torch.Tensor, chunk: int, levels: int, bits: int,
                  key: tuple[int, int], norm: bool, scales: torch.Tensor, signs: torch.Tensor,
                  packed: torch.Tensor) -> torch.Tensor:
    return _ef_chunked(x, e, out, chunk, FIN_QSGD if norm else FIN_TERN, float(levels), scales, None,
                       f"ef_stochastic<{_DT[x.dtype]}>",
                       (None, scales, np.float32(levels), np.int32(bits), np.uint32(key[0]), np.uint32(key[1]),
                        signs, packed))


def ef_sign(x: torch.Tensor, e: torch.Tensor | None, out: torch.Tensor, chunk: int, two_means: bool,
            scales: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    return _ef_chunked(x, e, out, chunk, FIN_ONEBIT if two_means else FIN_SIGN, 0.0, scales, None,
                       f"ef_sign<{_DT[x.dtype]}, {int(two_means)}>", (scales, bits))


def ef_sub_sent(out: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, bad: torch.Tensor | None = None
                ) -> torch.Tensor:
    """out[idx] -= vals at the sent positions only (idx unique); bad as above (or ORed into `bad`)."""
    bad = _flag(out) if bad is None else bad
    k = idx.numel()
    if k:
        with on_torch_stream(out.device):
            _launch("feedback.cu", f"ef_sub_sent<{_DT[out.dtype]}, {_idx_type(idx)}>", out.device, k,
                    (out, idx, vals.contiguous(), _i64(k), bad))
    return bad


def dgc_accumulate(g: torch.Tensor, u_old: torch.Tensor, v_old: torch.Tensor, u: torch.Tensor, v: torch.Tensor,
                   m: float, nesterov: bool) -> None:
    """u = m * u_old + g; v = v_old + u (Nesterov: v_old + (m * u + g)), one pass."""
    n = g.numel()
    if n:
        with on_torch_stream(g.device):
            _launch("feedback.cu", f"dgc_accumulate<{_DT[g.dtype]}>", g.device, n,
                    (g, u_old, v_old, u, v, _i64(n), np.float32(m), np.int32(int(nesterov))))


def dgc_sent(u: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, sent: torch.Tensor,
             bad: torch.Tensor | None = None) -> torch.Tensor:
    """v[idx] -= sent; u[idx] *= (sent == 0); a non-finite v[idx] sets bad (new, or the one given)."""
    bad = _flag(v) if bad is None else bad
    k = idx.numel()
    if k:
        with on_torch_stream(v.device):
            _launch("feedback.cu", f"dgc_sent<{_DT[v.dtype]}, {_idx_type(idx)}>", v.device, k,
                    (u, v, idx, sent.contiguous(), _i64(k), bad))
    return bad


def keep(ok_flag: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> None:
    """new = old when not ok_flag (0-d bool on the device); no memory moves when it is set."""
    n = new.numel()
    if n:
        word = {2: torch.int16, 4: torch.int32}[new.element_size()]
        with on_torch_stream(new.device):
            _launch("feedback.cu", f"ef_keep<{'u16' if word == torch.int16 else 'u32'}>", new.device, n,
                    (ok_flag.reshape(1).view(torch.uint8), old.view(-1).view(word), new.view(-1).view(word), _i64(n)))


# ---- selection -----------------------------------------------------------------------------
def _compact(x: torch.Tensor, state: torch.Tensor, mode: int, total: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ordered compaction of the selected elements: (int64 indices, values). With total=None
    the count is data-dependent and read back (one 8-byte device-to-host copy)."""
    n = x.numel()
    tiles = -(-n // TILE)
    dt = _DT[x.dtype]
    cnt_gt, cnt_eq = _empty(tiles, torch.int32, x), _empty(tiles, torch.int32, x)
    with on_torch_stream(x.device):
        _launch("select.cu", f"select_count<{dt}, {mode}>", x.device, 0, (x, _i64(n), state, cnt_gt, cnt_eq),
                grid=tiles)
        inc_gt = torch.cumsum(cnt_gt, 0, dtype=torch.int64)
        inc_eq = torch.cumsum(cnt_eq, 0, dtype=torch.int64)
        if total is None:
            total = int(inc_gt[-1])  # the one host sync: the output size depends on the data
        idx, vals = _empty(total, torch.int64, x), _empty(total, x.dtype, x)
        if total:
            _launch("select.cu", f"select_write<{dt}, {mode}>", x.device, 0,
                    (x, _i64(n), state, cnt_gt, cnt_eq, inc_gt, inc_eq, idx, vals), grid=tiles)
    return idx, vals


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of |x| (NaN > inf > finite, ties to the lowest index), indices ascending.
    Radix select over magnitude keys (8 bits a pass, state on the device), then an
    ordered compaction: no host sync. Needs 0 < k < numel."""
    state = _empty(4, torch.int64, x)
    hist = _empty(256, torch.int64, x)
    dt = _DT[x.dtype]
    n = x.numel()
    with on_torch_stream(x.device):
        _launch("select.cu", "radix_init", x.device, 0, (state, hist, _i64(k)), grid=1)
        for shift in ((24, 16, 8, 0) if x.dtype == torch.float32 else (8, 0)):
            _launch("select.cu", f"radix_hist<{dt}>", x.device, n, (x, _i64(n), state, hist, np.int32(shift)))
            _launch("select.cu", "radix_pick", x.device, 0, (state, hist, np.int32(shift)), block=32, grid=1)
    return _compact(x, state, 0, k)


def at_least(x: torch.Tensor, key: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every element whose magnitude key is >= key, in index order (one host sync: the count)."""
    state = torch.full((4,), key, dtype=torch.int64, device=x.device)
    return _compact(x, state, 1, None)


def sample_keys(x: torch.Tensor, stride: int, rows: bool, m: int) -> torch.Tensor:
    """Magnitude keys (int32) of dgc's strided sample: every stride-th run of 16 (rows) or element."""
    keys = _empty(m, torch.int32, x)
    with on_torch_stream(x.device):
        _launch("select.cu", f"sample_keys<{_DT[x.dtype]}>", x.device, m,
                (x, _i64(m), _i64(stride), np.int32(int(rows)), keys))
    return keys


def dgc(x: torch.Tensor, k: int, keys: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dgc: threshold = the r-th largest sampled key; compact the elements at or above it
    (one host sync: their count); the exact top k of those, else of everything. The result
    is the exact top k either way (the candidates hold every element of the top k)."""
    m = keys.numel()
    r = max(1, min(r, m))
    ordered = torch.sort(keys).values
    state = _empty(4, torch.int64, x)
    with on_torch_stream(x.device):
        _launch("select.cu", "set_threshold", x.device, 0, (ordered, _i64(m - r), state), block=32, grid=1)
    idx, vals = _compact(x, state, 1, None)
    if idx.numel() < k:
        return topk(x, k)
    if idx.numel() == k:
        return idx, vals
    pos, top = topk(vals, k)
    return torch.index_select(idx, 0, pos), top


def randomk(x: torch.Tensor, k: int, key: tuple[int, int], long_strata: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """randomk's index in each of the k strata and its value (rng.randbelow on the device)."""
    idx, vals = _empty(k, torch.int64, x), _empty(k, x.dtype, x)
    with on_torch_stream(x.device):
        _launch("select.cu", f"randomk_pick<{_DT[x.dtype]}>", x.device, k,
                (x, _i64(x.numel()), _i64(k), np.uint32(key[0]), np.uint32(key[1]), np.int32(int(long_strata)),
                 idx, vals))
    return idx, vals


def sentinel(x: torch.Tensor) -> torch.Tensor:
    """float32[1]: min * 0 + max * 0, i.e. 0 (signed like the CPU's) or NaN if x holds NaN/inf."""
    if x.numel() == 0:
        return torch.zeros(1, dtype=torch.float32, device=x.device)
    return chunk_stats(x, x.numel(), FIN_SENTINEL)[0]


# ---- decode scatter -------------------------------------------------------------------------
def _idx_type(idx: torch.Tensor) -> str:
    return {torch.int32: "int", torch.int64: "long long"}[idx.dtype]


def scatter_sorted(idx: torch.Tensor, vals: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(zeros with out[idx[j]] = vals[j], error flag int32[1]). The flag is set when an index
    is out of range or not strictly ascending; out-of-range indices are never written."""
    out = torch.zeros(numel, dtype=vals.dtype, device=vals.device)
    err = torch.zeros(1, dtype=torch.int32, device=vals.device)
    count = idx.numel()
    if count:
        with on_torch_stream(vals.device):
            _launch("scatter.cu", f"scatter_sorted<{_DT[vals.dtype]}, {_idx_type(idx)}>", vals.device, count,
                    (idx, vals, _i64(count), _i64(numel), out, err))
    return out, err


def scatter_randomk(key: torch.Tensor, vals: torch.Tensor, numel: int, sentinel_value: torch.Tensor,
                    long_strata: bool) -> torch.Tensor:
    """randomk decode: each value times its stratum length at the position the packet's key
    (int64[1], read on the device: no host sync) draws in that stratum; everything NaN when
    the sentinel is non-finite. Nothing to check: every drawn position is in range."""
    out = _empty(numel, vals.dtype, vals)
    k = vals.numel()
    s = sentinel_value.reshape(1).to(torch.float32).contiguous()
    with on_torch_stream(vals.device):
        if numel:
            _launch("scatter.cu", f"fill_sentinel<{_DT[vals.dtype]}>", vals.device, numel, (out, _i64(numel), s))
        if k:
            _launch("scatter.cu", f"scatter_randomk<{_DT[vals.dtype]}>", vals.device, k,
                    (vals, _i64(k), _i64(numel), key.reshape(1).contiguous(), np.int32(int(long_strata)), s, out))
    return out


# ---- byte planes ---------------------------------------------------------------------------
def split_planes(data: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Rotate each 2- or 4-byte float left by one bit and write its bytes as planes into `out` (uint8)."""
    s, n = data.element_size(), data.numel()
    if n:
        with on_torch_stream(data.device):
            _launch("bytes.cu", f"planes_split<{s}>", data.device, n, (data.view(torch.uint8), _i64(n), out))
    return out


def merge_planes(planes: torch.Tensor, itemsize: int, out: torch.Tensor) -> torch.Tensor:
    """Inverse of `split_planes`: uint8 planes into the uint8 bytes of `out`."""
    n = planes.numel() // itemsize
    if n:
        with on_torch_stream(planes.device):
            _launch("bytes.cu", f"planes_merge<{itemsize}>", planes.device, n, (planes, _i64(n), out))
    return out
