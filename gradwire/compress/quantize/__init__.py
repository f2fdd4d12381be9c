"""Dense quantizers, one module each: `fp8`, `fp4`, `int8`, `qsgd`, `terngrad`, `sign` (with
`onebit`). The machinery they share is `tiles` (tile loop, bit packing, `_Residual`,
`_Chunked`); qsgd and terngrad share the stochastic rounding of `stochastic`.

All of them cut the flat tensor into chunks (``chunk``/``bucket`` elements; the last one may
be shorter) and keep one or two fp32 numbers per chunk. Chunks are never looped over in
Python: every step is a torch op over 2-D ``(chunks, chunk)`` views, plus a 1-row view
for a trailing partial chunk (only fixed-size cache tiles are looped over: `tiles`).

Specs and defaults: ``fp8:format=e4m3|e5m2,chunk=1024``, ``fp4:chunk=32``, ``int8:chunk=1024``,
``qsgd:bits=8,bucket=512`` (bits 1..8; bits + 1 bits per element), ``terngrad:bucket=512``
(0: one scale per tensor), ``sign:chunk=1024``, ``onebit:chunk=1024``. Only qsgd and
terngrad are stochastic; none is summable.

Wire formats (n = numel, c = ceil(n / chunk), g = ceil(n / 8); every section is padded to
8 bytes, so ``packet bytes = header_size(ndim, nsections) + sum(align8(section bytes))``):

============  =======================================================  =========================
codec         sections, in order                                       section bytes
============  =======================================================  =========================
fp8     (4)   SCALES fp32 [c], DATA float8_e4m3fn/float8_e5m2 [n]      4c, n
fp4    (15)   SCALES fp32 [c], DATA uint8 [4g] (e2m1 codes, 2 per byte) 4c, 4g
int8    (5)   SCALES fp32 [c], OFFSETS fp32 [c], DATA uint8 [n]        4c, 4c, n
qsgd   (10)   SCALES fp32 [c] (L2 norms), BITS uint8 [g] (signs),      4c, g, bits * g
              DATA uint8 [bits * g] (levels)
terngrad (11) SCALES fp32 [c] (max |x|; c = 1 if bucket=0),            4c, g, g
              BITS uint8 [g] (signs), BITS uint8 [g] (nonzero)
sign   (12)   SCALES fp32 [c] (mean |x|), BITS uint8 [g] (signs)       4c, g
onebit (13)   SCALES fp32 [2c] (pairs: mean of x>=0, mean of x<0),     8c, g
              BITS uint8 [g] (signs)
============  =======================================================  =========================

Each codec's module gives its formula. All arithmetic is in fp32, round-to-nearest, no
fused multiply-add; fp16/bf16 inputs are first converted to fp32; "sign" is the IEEE sign
bit, so -0.0 counts as negative. The bit packing of BITS and the qsgd levels: `tiles`.

Non-finite input: a NaN/Inf makes its chunk's scale (norm, absmax, min/max, mean) non-finite,
and every decode multiplies or adds that scale, so the chunk decodes non-finite (onebit:
the chunk's half -- sign bit clear or set -- that held it, which includes its position).
The values encoded next to it are meaningless then; the step is meant to be skipped. The
same happens to finite chunks whose fp32 statistic overflows: qsgd's norm once sum(x**2)
passes FLT_MAX (|x| around 1e19), sign's and onebit's means once a chunk's sum does;
fp8, int8 and terngrad use max/min only and stay finite up to FLT_MAX.

Speed (CPU): a 25M tile loop issues ~1-2k torch ops: when the machine has more runnable
threads than cores, libgomp's spin-waiting barriers make each multi-threaded op slow
(seconds per encode), so run oversubscribed hosts with ``OMP_WAIT_POLICY=PASSIVE`` or
``torch.set_num_threads(1)``. Determinism: same input, config, Ctx and thread count give
the same bytes (a chunk longer than torch's parallel grain, 32768, may sum in another order
under another thread count).

Kernels: gradwire/cuda/kernels/elementwise.cu and feedback.cu (arithmetic shared in
quant.cuh). Tests: tests/compress/test_quantize.py, tests/cuda/test_cuda_parity.py.
"""

from __future__ import annotations

from .fp4 import FP4
from .fp8 import FP8
from .int8 import Int8
from .qsgd import QSGD
from .sign import OneBit, Sign
from .terngrad import TernGrad

__all__ = ["FP8", "FP4", "Int8", "QSGD", "TernGrad", "Sign", "OneBit"]
