"""Sparse index/value exchange: allgather variable-count (index, value) pairs, then sum.

Each rank's pairs travel as one byte buffer, so one allgatherv moves them::

    header  int64[3]  (k, numel, dtype code of the values — gradwire.compress.wire.DTYPE_CODES)
    indices int64[k]
    values  dtype[k]
    padding to a multiple of 8 bytes (every rank's part then starts 8-aligned)

A rank may send k = 0 pairs, or every index. Every rank checks every part (length, numel and
dtype agreement, indices in ``[0, numel)``) after the exchange, so bad input makes every rank
raise the same WireFormatError (a ValueError) instead of one rank raising and the others hanging.

Sums are deterministic and identical on every rank: the value at an index is accumulated
left to right, starting from +0, over its pairs in (rank, position) order, in float32 for
float16/bfloat16 values (float64 stays float64), then rounded once to the values' dtype.
`merge_dense` and `merge_sparse` agree bit for bit. On the CPU a stable sort and one
`index_add_` (sequential) do it; on CUDA no atomics decide an order: pairs are grouped by
index and summed in passes whose indices are unique, or on the host when an index repeats
more than 64 times, so a peer repeating one index a million times costs one pass, not a million.

No strategy uses it: it is the plain-MPI API's sparse exchange (`gradwire.comm.sparse_allgather`).
Tests: tests/comm/test_mpi.py (the merges in-process, the exchange under mpiexec:
tests/comm/mpi_programs/sparse_exchange.py), tests/comm/test_hostile_exchange.py,
tests/compress/hostile/ (the packed format against a corpus).
"""

from __future__ import annotations

import torch

from ..compress.wire import CODE_DTYPES, DTYPE_CODES
from ..errors import WireFormatError
from .backend import Backend, Work
from .base import accumulation_dtype

_HEADER = 3  # int64 words: k, numel, dtype code
_MAX_PASSES = 64  # off the CPU, more repeats of one index than this are summed on the host
_VALUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64)


def _padded(nbytes: int) -> int:
    return (nbytes + 7) // 8 * 8


def packed_size(k: int, dtype: torch.dtype) -> int:
    """Bytes of one rank's buffer holding k pairs with values of dtype."""
    item = dtype.itemsize
    return 8 * _HEADER + _padded(8 * k + item * k)


def pack(indices: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    """One rank's (indices, values) as a uint8 buffer on values' device (layout above)."""
    if indices.dim() != 1 or values.dim() != 1 or indices.numel() != values.numel():
        raise ValueError(f"indices and values must be 1-D of equal length, got {tuple(indices.shape)} "
                         f"and {tuple(values.shape)}")
    if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        raise TypeError(f"indices must be an integer tensor, got {indices.dtype}")
    if values.dtype not in _VALUE_DTYPES:
        raise TypeError(f"sparse values of {values.dtype} are not supported; use one of "
                        f"{', '.join(str(d) for d in _VALUE_DTYPES)}")
    if indices.device != values.device:
        raise ValueError(f"indices are on {indices.device} but values on {values.device}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    k = values.numel()
    buf = torch.zeros(packed_size(k, values.dtype), dtype=torch.uint8, device=values.device)
    words = buf[: 8 * (_HEADER + k)].view(torch.int64)
    words[:_HEADER] = torch.tensor([k, numel, DTYPE_CODES[values.dtype]], dtype=torch.int64)
    words[_HEADER:] = indices
    start = 8 * (_HEADER + k)
    buf[start: start + k * values.element_size()] = values.detach().contiguous().view(torch.uint8)
    return buf


def unpack(buf: torch.Tensor, dtype: torch.dtype, numel: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Split rank `rank`'s buffer into (indices, values), views of buf; checks its length,
    numel and dtype against this rank's (indices are range-checked by `check_indices`)."""
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise WireFormatError("a packed sparse buffer is 1-D uint8")
    if buf.numel() < 8 * _HEADER or buf.numel() % 8:
        raise WireFormatError(f"rank {rank}: sparse buffer of {buf.numel()} bytes is too short or not 8-aligned")
    if buf.storage_offset() % 8:  # only a foreign backend could hand us this: copy to align
        buf = buf.clone()
    k, their_numel, code = (int(v) for v in buf[: 8 * _HEADER].view(torch.int64).tolist())
    if their_numel != numel:
        raise WireFormatError(f"rank {rank} exchanged a sparse tensor of numel {their_numel}, this rank {numel}")
    if CODE_DTYPES.get(code) != dtype:
        raise WireFormatError(f"rank {rank} sent values of {CODE_DTYPES.get(code, f'code {code}')}, this rank {dtype}")
    if k < 0 or buf.numel() != packed_size(k, dtype):
        raise WireFormatError(f"rank {rank}: sparse buffer of {buf.numel()} bytes does not hold the "
                              f"{k} (int64, {dtype}) pairs its header declares")
    item = dtype.itemsize
    start = 8 * (_HEADER + k)
    indices = buf[8 * _HEADER: start].view(torch.int64)
    values = buf[start: start + k * item].view(dtype)
    return indices, values


def check_indices(parts: list[tuple[torch.Tensor, torch.Tensor]], numel: int) -> None:
    """WireFormatError naming the first rank and index outside [0, numel), if any (one host sync)."""
    sizes = [i.numel() for i, _ in parts]
    if not sum(sizes):
        return
    allidx = torch.cat([i for i, _ in parts])
    bad = (allidx < 0) | (allidx >= numel)
    if not bool(bad.any()):
        return
    first = int(bad.nonzero()[0, 0])
    rank, offset = 0, first
    while offset >= sizes[rank]:
        offset -= sizes[rank]
        rank += 1
    raise WireFormatError(f"sparse index out of range: rank {rank} sent index {int(allidx[first])} at position "
                          f"{offset}, but the tensor has numel {numel} (valid: 0..{numel - 1})")


def merge_sparse(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted unique indices (int64) and their summed values (the values' dtype), summed in
    (rank, position) order for every index; deterministic on every device."""
    unique, summed, dtype = _merge_acc(parts)
    return unique, summed.to(dtype)


def _merge_acc(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """(unique indices, sums in the accumulation dtype, values' dtype)."""
    if not parts:
        raise ValueError("nothing to merge: parts is empty")
    dtype = parts[0][1].dtype
    acc = accumulation_dtype(dtype)
    indices = torch.cat([i.to(torch.int64) for i, _ in parts])
    values = torch.cat([v for _, v in parts]).to(acc)
    n = indices.numel()
    if n == 0:
        return indices, values, dtype
    if values.device.type == "cpu":
        return (*_merge_host(indices, values), dtype)
    order = torch.argsort(indices, stable=True)  # stable: (rank, position) order within an index
    unique, inverse, counts = torch.unique_consecutive(indices[order], return_inverse=True, return_counts=True)
    values = values[order]
    summed = torch.zeros(unique.numel(), dtype=acc, device=values.device)
    if unique.numel() == n:  # no index repeats: one pass
        summed.index_add_(0, inverse, values)
        return unique, summed, dtype
    passes = int(counts.max())
    if passes > _MAX_PASSES:  # an index repeated many times (a hostile peer): one pass on the host
        unique, summed = _merge_host(indices.cpu(), values.cpu())
        return unique.to(values.device), summed.to(values.device), dtype
    # Occurrence number of each pair within its index; pass j adds every index's j-th pair,
    # so no pass holds an index twice: no atomic races, left-to-right order on the device.
    starts = torch.cumsum(counts, 0) - counts
    occurrence = torch.arange(n, device=values.device) - torch.repeat_interleave(starts, counts)
    by_pass = torch.argsort(occurrence, stable=True)
    sizes = torch.bincount(occurrence).tolist()
    inverse, values = inverse[by_pass], values[by_pass]
    start = 0
    for size in sizes:
        summed.index_add_(0, inverse[start: start + size], values[start: start + size])
        start += size
    return unique, summed, dtype


def _merge_host(indices: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU: after a stable sort each index's pairs are in (rank, position) order, and
    index_add_ adds in input order, so one pass sums them left to right however often an
    index repeats."""
    order = torch.argsort(indices, stable=True)
    unique, inverse = torch.unique_consecutive(indices[order], return_inverse=True)
    return unique, torch.zeros(unique.numel(), dtype=values.dtype).index_add_(0, inverse, values[order])


def merge_dense(parts: list[tuple[torch.Tensor, torch.Tensor]], numel: int, dtype: torch.dtype | None = None,
                device: torch.device | str | None = None, method: str = "auto") -> torch.Tensor:
    """Dense sum (numel elements) of every rank's pairs, in (rank, position) order per index.

    method: "index_add" adds each rank's pairs with index_add_ (sequential on CPU),
    "scatter" runs `merge_sparse` and writes its unique indices (no atomics: deterministic
    on CUDA), "auto" picks index_add on CPU and scatter elsewhere. Both give the same bits."""
    if dtype is None:
        dtype = parts[0][1].dtype if parts else torch.float32
    if device is None:
        device = parts[0][1].device if parts else "cpu"
    device = torch.device(device)
    if method == "auto":
        method = "index_add" if device.type == "cpu" else "scatter"
    acc = accumulation_dtype(dtype)
    out = torch.zeros(numel, dtype=acc, device=device)
    if method == "index_add":
        if device.type != "cpu":  # atomics: the order of repeated indices is not fixed
            raise ValueError("merge_dense(method='index_add') is deterministic only on the CPU; use 'scatter'")
        for indices, values in parts:
            if indices.numel():
                out.index_add_(0, indices.to(device=device, dtype=torch.int64), values.to(device=device, dtype=acc))
    elif method == "scatter":
        if parts and sum(i.numel() for i, _ in parts):
            unique, summed, _ = _merge_acc(parts)
            out[unique.to(device)] = summed.to(device)  # unique indices: a plain deterministic scatter
    else:
        raise ValueError(f"merge_dense method must be 'auto', 'index_add' or 'scatter', got {method!r}")
    return out if acc == dtype else out.to(dtype)


def sparse_allgather(backend: Backend, indices: torch.Tensor, values: torch.Tensor, numel: int,
                     dense: bool = True) -> Work:
    """Allgatherv every rank's (indices, values) — counts may differ, 0 included — and sum.

    Returns a Work of the dense sum (a 1-D tensor of numel elements, values' dtype and
    device) or, with dense=False, of the merged sparse sum ``(indices int64 ascending unique,
    values)``. Every rank gets bit-identical results. All ranks must pass the same numel and
    values dtype; out-of-range indices on any rank make every rank raise WireFormatError (on wait)."""
    dtype, device = values.dtype, values.device
    buf = pack(indices, values, numel)

    def merge(bufs: list[torch.Tensor]) -> object:
        parts = [unpack(b, dtype, numel, rank=r) for r, b in enumerate(bufs)]
        check_indices(parts, numel)
        if dense:
            return merge_dense(parts, numel, dtype, device)
        unique, summed = merge_sparse(parts)
        return unique.to(device), summed.to(device)

    return backend.allgatherv(buf, max_numel=packed_size(numel, dtype)).then(merge)  # every index, at most
