"""Checks of gradwire.hooks.horovod on a real Horovod job (horovodrun or mpiexec, 2+ ranks).

Run as ``horovodrun -np 2 python checks.py [name ...]``. Each rank prints
``CHECK <name> OK rank=<r> <seconds>s`` after a check passes there. A failing check prints
``CHECK <name> FAILED rank=<r>`` and its traceback to stderr, then ends the rank at once
(its peers may be blocked in a collective that will never match; the launcher stops them).
"""

from __future__ import annotations

import io
import os
import sys
import time
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import horovod.torch as hvd  # noqa: E402

import gradwire  # noqa: E402
from gradwire import CollectiveError, WireFormatError  # noqa: E402
from gradwire.comm.horovod import HorovodBackend  # noqa: E402
from gradwire.hooks import horovod as gwh  # noqa: E402

CHECKS = []
STEPS = 30
LR = 0.1

# One spec of each compressor; (spec, error_feedback, loss bound relative to the start).
SPECS = [
    ("none", True, 0.2), ("fp16", True, 0.2), ("bf16", True, 0.2), ("fp8", True, 0.2),
    ("int8", True, 0.2), ("qsgd:bits=4", True, 0.2), ("terngrad", True, 0.25), ("sign", True, 0.25),
    ("onebit", True, 0.25), ("topk:ratio=0.1", True, 0.25), ("randomk:ratio=0.2", False, 0.25),
    ("threshold:threshold=0.01", True, 0.25), ("dgc:ratio=0.1", True, 0.25),
    ("topk:ratio=0.1+fp16", True, 0.25), ("zstd", True, 0.2),
    # summable, but Horovod 0.28 cannot allreduce bf16: its packets (no indices) go by allgather
    ("randomk:ratio=0.5+bf16", False, 0.25),
]


def check(fn):
    CHECKS.append(fn)
    return fn


def make_model(seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


TEACHER = 0.3 * torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
EVAL_X = torch.randn(256, 16, generator=torch.Generator().manual_seed(8))
EVAL_Y = torch.tanh(EVAL_X @ TEACHER)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch: different on every rank, the same on every run."""
    g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
    x = torch.randn(32, 16, generator=g)
    return x, torch.tanh(x @ TEACHER)


def eval_loss(model: nn.Module) -> float:
    with torch.no_grad():
        return nn.functional.mse_loss(model(EVAL_X), EVAL_Y).item()


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def assert_same_on_all_ranks(t: torch.Tensor, what: str) -> None:
    gathered = hvd.allgather(t.reshape(1, -1), name=f"check.same.{what}")
    for r in range(hvd.size()):
        assert torch.equal(gathered[r], gathered[0]), f"{what}: rank {r} differs from rank 0"


def gw_optimizer(model: nn.Module, spec: str, error_feedback: bool = True, **kw) -> gwh.DistributedOptimizer:
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)
    return gwh.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=spec,
                                    error_feedback=error_feedback, **kw)


@check
def controller():
    """The job runs under the controller the launcher asked for (GRADWIRE_EXPECT_CONTROLLER)."""
    want = os.environ.get("GRADWIRE_EXPECT_CONTROLLER")
    got = "gloo" if hvd.gloo_enabled() else "mpi" if hvd.mpi_enabled() else "?"
    assert hvd.size() >= 2, f"needs 2+ ranks, got {hvd.size()}"
    assert want in (None, got), f"controller is {got}, expected {want}"


# ---- Compression (Horovod's own optimizer) ----------------------------------------------------
@check
def compression_fp16_matches_horovod_fp16():
    results = []
    for compression in (hvd.Compression.fp16, gwh.Compression.fp16):  # Horovod's own spelling
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        train(model, opt, 10)
        results.append(flat_params(model))
    assert torch.equal(results[0], results[1]), "gradwire fp16 differs from hvd.Compression.fp16"
    assert_same_on_all_ranks(results[1], "compression_fp16")


@check
def compression_summable_specs_train():
    for spec in (gwh.Compression.none, gwh.Compression.bf16, "randomk:ratio=0.5", "randomk:ratio=0.5+bf16"):
        model = make_model()
        before = eval_loss(model)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        compression = spec if isinstance(spec, gwh.Compression) else gwh.Compression(spec)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
        train(model, opt, STEPS)
        after = eval_loss(model)
        assert after < 0.8 * before, f"{spec}: loss {before:.4f} -> {after:.4f}"
        assert_same_on_all_ranks(flat_params(model), f"compression.{spec}")


@check
def compression_rejects_non_summable():
    for spec in ("topk:ratio=0.1", "qsgd:bits=4", "fp16+zstd"):
        try:
            gwh.Compression(spec)
        except ValueError as e:
            assert "DistributedOptimizer" in str(e), str(e)
        else:
            raise AssertionError(f"Compression({spec!r}) did not raise")


# ---- DistributedOptimizer -----------------------------------------------------------------
@check
def every_compressor_trains():
    report, finals = [], {}
    for spec, ef, bound in SPECS:
        model = make_model()
        opt = gw_optimizer(model, spec, ef)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        before = eval_loss(model)
        train(model, opt, STEPS)
        after = eval_loss(model)
        report.append(f"{spec}: {before:.4f} -> {after:.4f}")
        assert after < bound * before, f"{spec}: loss {before:.4f} -> {after:.4f} (bound {bound} x start)"
        finals[spec] = flat_params(model)
        assert_same_on_all_ranks(finals[spec], f"params.{spec}")
    for spec in finals:  # lossy ones really compressed; lossless ones are exact
        assert torch.equal(finals[spec], finals["none"]) == (spec in ("none", "zstd")), spec
    if hvd.rank() == 0:
        print("\n".join(report), file=sys.stderr, flush=True)


@check
def matches_horovod_fp16_without_feedback():
    """fp16 through gradwire's optimizer (no feedback) is Horovod's fp16 allreduce."""
    results = []
    for make in (lambda m, o: hvd.DistributedOptimizer(o, named_parameters=m.named_parameters(),
                                                       compression=hvd.Compression.fp16),
                 lambda m, o: gwh.DistributedOptimizer(o, named_parameters=m.named_parameters(),
                                                       compression="fp16", error_feedback=False)):
        model = make_model()
        opt = make(model, torch.optim.SGD(model.parameters(), lr=LR))
        train(model, opt, 10)
        results.append(flat_params(model))
    assert torch.equal(results[0], results[1]), "gradwire DistributedOptimizer fp16 differs from Horovod's"


@check
def resume_continues_identically():
    for spec, ef in (("topk:ratio=0.1", True), ("dgc:ratio=0.1", True), ("randomk:ratio=0.2", False),
                     ("qsgd:bits=4", True)):
        model = make_model()
        opt = gw_optimizer(model, spec, ef)
        train(model, opt, 12)
        straight = flat_params(model)

        model = make_model()
        opt = gw_optimizer(model, spec, ef)
        train(model, opt, 6)
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
        saved = opt.state_dict()["gradwire"]
        if ef:
            assert saved["feedback"]["residuals"], f"{spec}: no residuals saved"
        buf.seek(0)
        ckpt = torch.load(buf)
        model = make_model(seed=99)  # different init: everything must come from the checkpoint
        opt = gw_optimizer(model, spec, ef)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        hvd.broadcast_optimizer_state(opt, root_rank=0)  # non-empty state: no extra step
        train(model, opt, 6, start=6)
        assert torch.equal(flat_params(model), straight), f"{spec}: resumed run differs"
        if ef:  # and losing the residuals does change the result
            model = make_model()
            opt = gw_optimizer(model, spec, ef)
            model.load_state_dict(ckpt["model"])
            sd = dict(ckpt["opt"])
            del sd["gradwire"]
            opt.load_state_dict(sd)
            train(model, opt, 6, start=6)
            assert not torch.equal(flat_params(model), straight), f"{spec}: residuals had no effect"


@check
def accumulation_and_skip_synchronize():
    model = make_model()
    opt = gw_optimizer(model, "topk:ratio=0.1", backward_passes_per_step=2)
    before = eval_loss(model)
    for step in range(STEPS):
        opt.zero_grad()
        for half in range(2):
            x, y = batch(2 * step + half)
            (nn.functional.mse_loss(model(x), y) / 2).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        with opt.skip_synchronize():
            opt.step()
    after = eval_loss(model)
    assert after < 0.6 * before, f"loss {before:.4f} -> {after:.4f}"
    assert_same_on_all_ranks(flat_params(model), "accumulation")


@check
def unused_parameter_and_sum_op():
    model = make_model()
    extra = nn.Linear(4, 4)  # never used in the forward pass
    params = list(model.named_parameters()) + [("extra." + n, p) for n, p in extra.named_parameters()]
    opt = torch.optim.SGD([p for _, p in params], lr=LR / hvd.size())
    opt = gwh.DistributedOptimizer(opt, named_parameters=params, compression="int8", op=hvd.Sum)
    train(model, opt, 5)
    assert extra.weight.grad is not None and not extra.weight.grad.any()
    assert_same_on_all_ranks(flat_params(model), "sum_op")


@check
def bad_bytes_from_one_rank_raise_everywhere():
    """Rank 1 sends same-size packets of shape (1,) holding 100: every rank raises WireFormatError
    (no rank adds 100 to its gradients), and the ranks stay in step."""
    model = make_model()
    opt = gw_optimizer(model, "topk:k=1", error_feedback=False)
    before = flat_params(model).clone()
    backend = opt.gradwire_strategy("0.weight").backend
    real = backend.allgatherv

    def forged(t, max_numel):  # the strategy's message (length table, packet), its packet replaced
        packet = gradwire.compressor("topk:k=1").encode(torch.tensor([100.0])).tensor()
        return real(torch.cat([torch.tensor([packet.numel()]).view(torch.uint8), packet]), max_numel)

    if hvd.rank() == 1:
        backend.allgatherv = forged
    try:
        x, y = batch(0)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        try:
            opt.step()
        except WireFormatError as e:  # rank 1 sees its own message altered, the others a bad packet
            wanted = ("altered",) if hvd.rank() == 1 else ("receiver expects", "codec id")
            assert any(w in str(e) for w in wanted), str(e)
        else:
            raise AssertionError("no WireFormatError")
    finally:
        backend.__dict__.pop("allgatherv", None)
    assert torch.equal(flat_params(model), before)
    assert_same_on_all_ranks(flat_params(model), "bad_bytes")
    train(model, opt, 2)  # the optimizer still works afterwards
    assert_same_on_all_ranks(flat_params(model), "bad_bytes_after")


# ---- HorovodBackend ----------------------------------------------------------------------------
@check
def exchanges_go_through_horovod_backend():
    """Every parameter's exchange is a shared strategy over a HorovodBackend: allreduce for
    summable payloads, allgather for packets, or the strategy named by strategy=."""
    for spec, expected in (("fp16", "allreduce"), ("topk:ratio=0.1", "allgather"),
                           ("randomk:ratio=0.5+bf16", "allgather")):  # (Horovod cannot sum bf16)
        model = make_model()
        opt = gw_optimizer(model, spec)
        train(model, opt, 2)
        for name, _ in model.named_parameters():
            strategy = opt.gradwire_strategy(name)
            assert type(strategy.backend) is HorovodBackend, type(strategy.backend)
            assert strategy.name == expected, (spec, name, strategy.name)
        assert opt.last_stats is not None and opt.last_stats["step"] == 1, opt.last_stats  # (steps 0, 1)
        stats = opt.take_stats()
        assert stats.bytes_sent > 0 and set(stats.buckets) == {n for n, _ in model.named_parameters()}, stats
        assert stats.bytes_sent > opt.last_stats["bytes_sent"] > 0  # two steps' totals, one step's record
        assert opt.take_stats().bytes_sent == 0  # taken: a fresh record starts
        assert opt.get_config()["compression"] == str(gradwire.compressor(spec))
    for strategy in ("allgather", "artopk"):  # named strategies train and keep the ranks identical
        model = make_model()
        before = eval_loss(model)
        opt = gw_optimizer(model, "topk:ratio=0.2", strategy=strategy)
        train(model, opt, STEPS)
        assert eval_loss(model) < 0.6 * before, strategy
        assert opt.gradwire_strategy("0.weight").name == strategy
        assert_same_on_all_ranks(flat_params(model), f"strategy.{strategy}")
    try:  # a checkpoint of another strategy fails clearly
        gw_optimizer(make_model(), "topk:ratio=0.2").load_gradwire_state_dict(opt.gradwire_state_dict())
    except ValueError as e:
        assert "strategy" in str(e), str(e)
    else:
        raise AssertionError("a state of strategy artopk loaded into the default optimizer")


@check
def backend_collectives():
    backend = HorovodBackend()
    rank, world = backend.rank, backend.world_size
    mine = torch.arange(rank * 10, rank * 10 + 5, dtype=torch.float32)
    got = backend.allgather(mine).wait()
    assert [g.tolist() for g in got] == [list(range(r * 10, r * 10 + 5)) for r in range(world)]
    parts = backend.allgatherv(torch.full((rank + 1,), rank, dtype=torch.int16), max_numel=world).wait()
    assert [p.tolist() for p in parts] == [[r] * (r + 1) for r in range(world)]
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8):
        t = torch.full((7,), rank + 1, dtype=dtype)
        assert backend.allreduce(t).wait().tolist() == [world * (world + 1) // 2] * 7, dtype
    t = torch.full((3,), 2.0 + rank)
    assert torch.equal(HorovodBackend(average=True).allreduce(t).wait(), torch.full((3,), 2.0 + (world - 1) / 2))
    t = torch.tensor([7, 8, 9]) if rank == world - 1 else torch.zeros(3, dtype=torch.int64)
    assert backend.broadcast(t, world - 1).wait().tolist() == [7, 8, 9]
    assert backend.allgather_ints([rank, -rank]) == [[r, -r] for r in range(world)]
    assert backend.allgather_text(f"rank {rank}") == [f"rank {r}" for r in range(world)]
    chunks = [torch.full((dst + 1,), 100 * rank + dst, dtype=torch.float64) for dst in range(world)]
    for kw in ({"max_recv": world}, {"recv_counts": [rank + 1] * world}):
        out = backend.alltoall(chunks, **kw).wait()
        assert [o.tolist() for o in out] == [[100.0 * src + rank] * (rank + 1) for src in range(world)], kw
    # exchanges issued in a different order on every rank meet by their names
    works = {}
    for i in (range(4) if rank % 2 == 0 else reversed(range(4))):
        with backend.named(f"check.order.{i}"):
            works[i] = backend.allgatherv(torch.full((i + 1,), float(rank)), max_numel=8)
    for i in range(4):
        assert [w.tolist() for w in works[i].wait()] == [[float(r)] * (i + 1) for r in range(world)]


@check
def oversize_allgatherv_claim_raises_before_allocating():
    """A peer claiming more than the receivers' bound (honestly, or 2**40 elements by a forged
    size word) makes every rank raise WireFormatError naming it, and no rank issues the data
    phase (Horovod would allocate the claim)."""
    backend = HorovodBackend()
    last = backend.world_size - 1
    issued: list[str] = []
    real = hvd.allgather_async

    def spy(t, name=None, **kw):
        issued.append(name)
        if hvd.rank() == last and name.startswith("check.claim.forged") and t.dtype == torch.int64:
            t = t.clone()
            t[0, 0] = 1 << 40  # the size word of this rank's row
        return real(t, name=name, **kw)

    hvd.allgather_async = spy
    try:
        for scope, numel in (("check.claim.honest", 64 if hvd.rank() == last else 4), ("check.claim.forged", 4)):
            with backend.named(scope):
                work = backend.allgatherv(torch.ones(numel), max_numel=16)
            try:
                work.wait()
            except WireFormatError as e:
                assert e.peer == last and "16" in str(e), str(e)
            else:
                raise AssertionError(f"{scope}: no WireFormatError")
    finally:
        hvd.allgather_async = real
    assert len(issued) == 2 and all(".allgatherv.0" in n for n in issued), issued  # the sizes phases only
    after = backend.allgatherv(torch.ones(2), max_numel=2).wait()  # the ranks are still in step
    assert [p.tolist() for p in after] == [[1.0, 1.0]] * backend.world_size


def main() -> None:
    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    print(f"PID rank={rank} {os.getpid()}", flush=True)
    wanted = set(sys.argv[1:])
    for fn in CHECKS:
        if wanted and fn.__name__ not in wanted:
            continue
        t0 = time.monotonic()
        try:
            fn()
        except BaseException:  # noqa: BLE001 - report, then end the rank at once
            sys.stderr.write(f"CHECK {fn.__name__} FAILED rank={rank}\n{traceback.format_exc()}\n")
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(1)
        print(f"CHECK {fn.__name__} OK rank={rank} {time.monotonic() - t0:.1f}s", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
