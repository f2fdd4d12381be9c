"""Hook states are per rank: they record whose they are, refuse another rank's, and travel to a
rank-0-only checkpointer in their all-ranks form. And the watchdog: a hook that never runs, or
whose Adam direction the optimizer does not receive as sent, warns (real gloo ranks)."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradwire.comm import GradientExchanger
from gradwire.comm.torch_dist import TorchDistBackend
from gradwire.hooks import ddp as gw_ddp
from gradwire.errors import WireFormatError
from gradwire.hooks import ranks, watchdog
from multiproc import run_ranks

IN, OUT = 16, 4
SPEC, OPTIONS = "topk:ratio=0.1", {"strategy": "allgather"}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, OUT))


def step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, i: int, clip: float | None = None) -> None:
    g = torch.Generator().manual_seed(100 * i + rank)
    x = torch.randn(8, IN, generator=g)
    loss = (model(x) - x[:, :OUT].cos()).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()


def exchanger_state(exchanger: GradientExchanger, rank: int) -> dict:
    """Rank 0's GradientExchanger state, on every rank."""
    sent = [exchanger.state_dict() if rank == 0 else None]
    torch.distributed.broadcast_object_list(sent, src=0)  # (test-only: our own trusted ranks)
    return sent[0]


def fresh(rank: int) -> tuple[DDP, torch.optim.Optimizer]:
    model = DDP(make_model(), bucket_cap_mb=0.002)  # several buckets
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def _scenarios(rank: int, world: int, path: str) -> dict:
    out: dict = {}
    # 1. train 4 steps, save the all-ranks form from rank 0 only, train 4 more: the uninterrupted run
    model, opt = fresh(rank)
    state = gw_ddp.register(model, SPEC, **OPTIONS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(4):
            step(model, opt, rank, i)
    out["warned_when_called"] = [str(w.message) for w in caught if "has not been called" in str(w.message)]
    everyone = state.all_ranks_state_dict()
    own = state.state_dict()
    out["own_rank"], out["own_world"] = own["rank"], own["world_size"]
    out["held"] = everyone["ranks"] is not None
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "gradwire": everyone,
                    "rank0_only": own}, f"{path}/ckpt.pt")
    torch.distributed.barrier()
    for i in range(4, 8):
        step(model, opt, rank, i)
    out["uninterrupted"] = [p.detach().clone() for p in model.parameters()]

    ckpt = torch.load(f"{path}/ckpt.pt", weights_only=True)

    def resume(load: str) -> list[torch.Tensor]:
        m, o = fresh(rank)
        m.module.load_state_dict(ckpt["model"])
        o.load_state_dict(ckpt["opt"])
        s = gw_ddp.register(m, SPEC, **OPTIONS)
        if load == "all":
            s.load_state_dict(ckpt["gradwire"])
        for i in range(4, 8):
            step(m, o, rank, i)
        return [p.detach().clone() for p in m.parameters()]

    # 2. every rank loads the one file rank 0 wrote, and keeps its own entry
    out["resumed"] = resume("all")
    out["resumed_without_state"] = resume("none")
    # 3. rank 0's own state on rank 1, and rank 1's empty marker, are refused
    s = gw_ddp.GradwireState(SPEC, **OPTIONS)
    try:
        s.load_state_dict(ckpt["rank0_only"])
        out["rank0_state_loads"] = "loaded"
    except ValueError as e:
        out["rank0_state_loads"] = str(e)
    exchanger = GradientExchanger(SPEC, TorchDistBackend(), strategy="allgather")
    try:
        exchanger.load_state_dict(exchanger_state(exchanger, rank))
        out["exchanger_loads"] = "loaded"
    except ValueError as e:
        out["exchanger_loads"] = str(e)
    if rank == 1:
        try:
            s.load_state_dict(everyone)
            out["marker_loads"] = "loaded"
        except ValueError as e:
            out["marker_loads"] = str(e)

    # 4. precondition="adam": clipping Adam's direction warns; clip= in the hook clips the true gradient
    for name, hook_spec, user_clip in (("clipped_direction", "adam", 1.0), ("clip_in_hook", "adam:clip=0.05", None),
                                       ("adamw_kept", "adam", None)):
        m, o = fresh(rank)
        if name == "adamw_kept":
            o = torch.optim.AdamW(m.parameters(), lr=1e-3)
        s = gw_ddp.register(m, SPEC, precondition=hook_spec, **OPTIONS)
        local = make_model()  # this rank's gradient, unaveraged, to check the norm the hook reports
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(3):
                local.load_state_dict(m.module.state_dict())
                local.zero_grad()
                x = torch.randn(8, IN, generator=torch.Generator().manual_seed(100 * i + rank))
                (local(x) - x[:, :OUT].cos()).pow(2).mean().backward()
                true_norm = float(torch.nn.utils.clip_grad_norm_(local.parameters(), float("inf")))
                step(m, o, rank, i, clip=user_clip)
        out[name] = {"warnings": [str(w.message) for w in caught if "precondition" in str(w.message)],
                     "grads_applied": [str(w.message) for w in caught if "sgd_like" in str(w.message)],
                     "grad_norm": s.last_stats.get("grad_norm"), "true_norm": true_norm,
                     "finite": all(torch.isfinite(p).all() for p in m.parameters())}

    # 5. the default strategy ("auto") says once, at WARNING, when it sends buckets uncompressed
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("gradwire").addHandler(handler)
    m, o = fresh(rank)
    s = gw_ddp.register(m, "topk:ratio=0.01")
    for i in range(14):
        step(m, o, rank, i)
    logging.getLogger("gradwire").removeHandler(handler)
    # 6. a peer announcing a state far larger than this rank's is refused on every rank, before any allocation
    lying = {"residual": torch.zeros(1 << 20 if rank == 1 else 16)}  # 4 MiB against 64 bytes
    try:
        ranks.gather_states(lying)
        out["lying_peer"] = "gathered"
    except WireFormatError as e:
        out["lying_peer"] = str(e)
    out["auto"] = {"choices": dict(s.strategy.choices) or {"all": s.strategy.choice},
                   "warnings": [r.getMessage() for r in records if "uncompressed" in r.getMessage()]}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(_scenarios, 2, str(tmp_path_factory.mktemp("ckpt")), timeout=240)


def test_states_record_rank_and_world(results):
    assert [(r["own_rank"], r["own_world"]) for r in results] == [(0, 2), (1, 2)]
    assert [r["held"] for r in results] == [True, False]  # gathered on rank 0 only


def test_a_rank0_only_checkpoint_resumes_every_rank_bit_identically(results):
    for r in results:
        assert all(torch.equal(a, b) for a, b in zip(r["uninterrupted"], r["resumed"]))
        # without gradwire's state the resumed run differs: the check above is not vacuous
        assert not all(torch.equal(a, b) for a, b in zip(r["uninterrupted"], r["resumed_without_state"]))


def test_another_ranks_state_is_refused(results):
    assert results[0]["rank0_state_loads"] == "loaded"
    assert "saved by rank 0 of 2; this is rank 1 of 2" in results[1]["rank0_state_loads"]
    assert "load the one rank 0 saved" in results[1]["marker_loads"]
    assert results[0]["exchanger_loads"] == "loaded"
    assert "saved by rank 0 of 2; this is rank 1 of 2" in results[1]["exchanger_loads"]


def test_a_state_far_larger_than_this_ranks_is_refused_on_every_rank(results):
    for r in results:
        assert "cannot be a state of the same config" in r["lying_peer"] and "announced states of" in r["lying_peer"]


def test_a_called_hook_does_not_warn(results):
    assert [r["warned_when_called"] for r in results] == [[], []]


def test_clipping_adams_direction_warns_and_clip_in_the_hook_clips_the_true_gradient(results):
    for r in results:
        warned = r["clipped_direction"]["warnings"]
        assert len(warned) == 1 and "precondition='adam:clip=1.0'" in warned[0], warned
        assert r["clipped_direction"]["grads_applied"] == []
        kept = r["adamw_kept"]["grads_applied"]
        assert len(kept) == 1 and "the optimizer is AdamW" in kept[0] and "adam_spec(old_opt" in kept[0]
        hooked = r["clip_in_hook"]
        assert hooked["warnings"] == [] and hooked["finite"]
        assert hooked["grad_norm"] == pytest.approx(hooked["true_norm"], rel=1e-5)


def _never_called(rank: int, world: int) -> dict:
    """(2 ranks: with one process there is no exchange to miss, and the watchdog stays quiet)"""
    out = {}
    state = gw_ddp.GradwireState(SPEC, **OPTIONS)  # handed to nothing, as Lightning does on CPU
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(watchdog.SILENT_STEPS + 3):
            step(model, opt, rank, i)
    out["unattached"] = [str(w.message) for w in caught if "has not been called" in str(w.message)]
    out["unattached_iter"] = state.iter
    del state
    hooked, other = make_model(), make_model()
    scoped = gw_ddp.GradwireState(SPEC, model=hooked, **OPTIONS)  # (as register() attaches it)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other_opt = torch.optim.SGD(other.parameters(), lr=0.01)
        for i in range(watchdog.SILENT_STEPS + 2):  # another model trains: not this hook's business
            step(other, other_opt, rank, i)
        out["quiet"] = [str(w.message) for w in caught if "has not been called" in str(w.message)]
        hooked_opt = torch.optim.SGD(hooked.parameters(), lr=0.01)
        for i in range(watchdog.SILENT_STEPS):
            step(hooked, hooked_opt, rank, i)
    out["scoped"] = [str(w.message) for w in caught if "has not been called" in str(w.message)]
    out["scoped_iter"] = scoped.iter
    return out


def test_a_hook_that_is_never_called_warns_once_and_only_for_its_models_steps():
    for r in run_ranks(_never_called, 2):
        assert len(r["unattached"]) == 1 and "Lightning's DDPStrategy" in r["unattached"][0]
        assert r["quiet"] == [] and len(r["scoped"]) == 1
        assert r["unattached_iter"] == r["scoped_iter"] == 0


def test_an_all_ranks_state_from_another_world_size_is_refused():
    saved = {"format": ranks.ALL_RANKS, "version": 1, "world_size": 2, "ranks": [{}, {}]}
    with pytest.raises(ValueError, match="saved by 2 ranks; this job has 1"):
        gw_ddp.GradwireState(SPEC, **OPTIONS).load_state_dict(saved)


def test_precondition_clip_must_be_positive():
    with pytest.raises(ValueError, match="clip must be > 0"):
        gw_ddp.GradwireState(SPEC, precondition="adam:clip=0", **OPTIONS)
    with pytest.raises(ValueError, match="must be a number"):
        gw_ddp.GradwireState(SPEC, precondition="adam:clip=x", **OPTIONS)


def test_auto_says_once_when_it_does_not_compress(results):
    for r in results:
        auto = r["auto"]
        dense = sum(c == "dense" for c in auto["choices"].values())
        if dense:
            assert len(auto["warnings"]) == 1, auto
            assert f"{dense} of {len(auto['choices'])} buckets uncompressed" in auto["warnings"][0]
            assert "To compress anyway pass strategy=" in auto["warnings"][0]
        else:  # (a busy host may time compression faster: then nothing to say)
            assert auto["warnings"] == []


def test_a_resumed_optimizer_with_a_fresh_hook_warns_at_the_first_step():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step(model, opt, 0, 0)
    saved_opt = opt.state_dict()

    def resume(load_hook: bool) -> list[str]:
        again = make_model()
        again_opt = torch.optim.AdamW(again.parameters(), lr=1e-3)
        again_opt.load_state_dict(saved_opt)
        state = gw_ddp.GradwireState(SPEC, model=again, **OPTIONS)
        if load_hook:
            state.load_state_dict(gw_ddp.GradwireState(SPEC, **OPTIONS).state_dict())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(2):
                step(again, again_opt, 0, i)
        return [str(w.message) for w in caught if "resumes from a checkpoint" in str(w.message)]

    fresh = resume(load_hook=False)
    assert len(fresh) == 1 and "(at step 1)" in fresh[0] and "state.load_state_dict(ckpt['gradwire'])" in fresh[0]
    assert resume(load_hook=True) == []


def test_watched_parameters_can_still_be_swapped():
    """FSDP2 and module.to_empty swap parameters' contents (`torch.utils.swap_tensors`), which a weak
    reference on a parameter would forbid: the watches hold them strongly."""
    model = make_model()
    gw_ddp.GradwireState(SPEC, model=model, precondition="adam", **OPTIONS)
    first = next(model.parameters())
    torch.utils.swap_tensors(first, torch.nn.Parameter(torch.zeros_like(first)))
    assert torch.count_nonzero(first) == 0


def test_sgd_like_keeps_the_users_groups_and_adamws_decoupled_decay():
    """SGD's weight decay on Adam's direction is AdamW's decoupled decay: one step of each from the
    same point with the same direction lands on the same parameters."""
    from gradwire.hooks.precondition import adam_spec, sgd_like

    model = make_model()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                              lr=3e-3, betas=(0.9, 0.95))
    sgd = sgd_like(adamw)
    assert [(g["lr"], g["weight_decay"], g["momentum"]) for g in sgd.param_groups] == [(3e-3, 0.1, 0.0), (3e-3, 0.0, 0.0)]
    assert adam_spec(adamw, clip=1.0) == "adam:beta1=0.9,beta2=0.95,eps=1e-08,clip=1"
    direction = [torch.randn_like(p) for p in model.parameters()]
    start = [p.detach().clone() for p in model.parameters()]
    for p, d in zip(model.parameters(), direction):
        p.grad = d.clone()
    sgd.step()
    by_sgd = [p.detach().clone() for p in model.parameters()]
    expected = [(s * (1 - 3e-3 * (0.1 if s.dim() >= 2 else 0.0))) - 3e-3 * d for s, d in zip(start, direction)]
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(by_sgd, expected))
