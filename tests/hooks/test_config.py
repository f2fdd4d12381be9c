"""One config object and one API shape for the three entry points: the DDP hook, the FSDP2 hook
and `GradientExchanger` (gradwire/comm/config.py). Process groups are real gloo groups."""

from __future__ import annotations

import inspect
import pickle
import warnings

import pytest
import torch
from torch import nn

from gradwire.comm.api import ExchangerConfig, GradientExchanger
from gradwire.comm.config import ExchangeConfig
from gradwire.comm.base import ExchangeStats
from gradwire.experiments.config import parse_method
from gradwire.hooks import ddp as gw_ddp
from gradwire.hooks import fsdp as gw_fsdp
from gradwire.hooks.fsdp import FSDPConfig
from multiproc import run_ranks

# Fingerprints computed by the entry points before the config object existed: saved states
# carry them, so they decide whether old checkpoints load.
DDP_FINGERPRINTS = [
    ({"compressor": "topk:ratio=0.01"}, 1171128992),
    ({"compressor": "topk:ratio=0.1", "strategy": "allgather"}, 1127837264),
    ({"compressor": "fp16", "strategy": "allreduce"}, 696442292),
    ({"compressor": "none", "strategy": "powersgd", "rank": 2}, 2890208355),
    ({"compressor": "none", "strategy": "auto", "inner": "powersgd", "rank": 2, "ranks_per_node": 2, "trials": 1},
     4268595729),
    ({"compressor": "topk:ratio=0.1", "strategy": "hierarchical", "inner": "allgather", "ranks_per_node": 2},
     3661092278),
    ({"compressor": "topk:ratio=0.01,indices=raw", "strategy": "allgather", "warmup": 5}, 4167825230),
    ({"compressor": "topk:ratio=0.1", "strategy": "allgather", "precondition": "adam", "seed": 3, "start_iter": 4},
     1436750777),
    ({"compressor": "qsgd:bits=4", "strategy": "allgather", "error_feedback": True}, 4248945034),
]
FSDP_FINGERPRINTS = [  # (options, hsdp, fingerprint with no FSDP groups: layout 0)
    ({"compressor": "int8"}, False, 51464321),
    ({"compressor": "topk:ratio=0.01", "seed": 2, "min_numel": 16}, False, 2081656345),
    ({"compressor": "none"}, False, 1608512437),
    ({"compressor": "qsgd:bits=4", "error_feedback": True}, False, 249999254),
    ({"compressor": "int8"}, True, 1324102989),
    ({"compressor": "none", "strategy": "powersgd", "rank": 2}, True, 251308813),
    ({"compressor": "none", "strategy": "powersgd", "warm_start": False, "rank": 2}, True, 1262314137),
    ({"compressor": "fp16", "seed": 1}, True, 1589228569),
    ({"compressor": "topk:ratio=0.01", "strategy": "allgather", "min_numel": 8}, True, 3090559205),
]
EXCHANGER_CONFIGS = [  # (options, the exchanger's config() before the config object)
    ({}, {"compressor": "topk", "strategy": "allgather", "error_feedback": True, "seed": 0, "bucket_mb": None,
          "per_tensor": True, "strategy_options": {}}),
    ({"compressor": "none", "strategy": "powersgd", "rank": 2, "seed": 4},
     {"compressor": "none", "strategy": "powersgd", "error_feedback": True, "seed": 4, "bucket_mb": None,
      "per_tensor": True, "strategy_options": {"rank": 2}}),
    ({"compressor": "fp16", "strategy": "allreduce", "bucket_mb": 1.5, "per_tensor": False},
     {"compressor": "fp16", "strategy": "allreduce", "error_feedback": False, "seed": 0, "bucket_mb": 1.5,
      "per_tensor": False, "strategy_options": {}}),
]


@pytest.mark.parametrize("options, fingerprint", DDP_FINGERPRINTS)
def test_ddp_fingerprints_are_those_of_saved_states(options, fingerprint):
    state = gw_ddp.GradwireState(**options)
    assert state.fingerprint() == fingerprint
    saved = {**state.state_dict(), "fingerprint": fingerprint, "iter": 3, "config": {}}
    state.load_state_dict(saved)  # a state saved before the config object loads: its fingerprint decides
    assert state.iter == 3


@pytest.mark.parametrize("options, hsdp, fingerprint", FSDP_FINGERPRINTS)
def test_fsdp_fingerprints_are_those_of_saved_states(options, hsdp, fingerprint):
    config = gw_fsdp.FSDPConfig(hsdp=hsdp, **options)
    assert config.fingerprint(" layout=0x00000000") == fingerprint
    if not hsdp:
        assert gw_fsdp.FSDPGradwireState(**options).fingerprint() == fingerprint


@pytest.mark.parametrize("options, old", EXCHANGER_CONFIGS)
def test_exchanger_config_is_what_its_saved_states_hold(options, old):
    assert ExchangerConfig(**options).get_config() == old


# ---- the same rules in every entry point ------------------------------------------------------
def test_powersgd_turns_error_feedback_on_and_its_traits_follow_inner():
    for config in (gw_ddp.DDPConfig("none", "powersgd"), gw_fsdp.FSDPConfig("none", "powersgd", hsdp=True),
                   ExchangerConfig("none", "powersgd"), gw_ddp.DDPConfig("none", "auto", inner="powersgd"),
                   ExchangerConfig("none", "auto", inner="powersgd"),
                   ExchangerConfig("none", "hierarchical", inner="powersgd")):
        assert config.error_feedback is True, config
        assert config.build_options()["seed"] == config.seed
    assert ExchangerConfig("none", "powersgd", error_feedback=False).error_feedback is False
    assert ExchangerConfig("none", "allreduce").error_feedback is False  # "auto" follows the compressor
    assert "seed" not in ExchangerConfig("none", "hierarchical", inner="allgather").build_options()


def test_unknown_strategies_options_and_specs_are_rejected_at_construction_everywhere():
    makers = {"ddp": gw_ddp.GradwireState, "fsdp": gw_fsdp.FSDPGradwireState,
              "exchanger": lambda *a, **kw: GradientExchanger(*a, backend=object(), **kw)}  # (never reached)
    for name, make in makers.items():
        with pytest.raises(ValueError, match="unknown strategy 'bogus'; valid: .*allgather"):
            make("topk:ratio=0.1", strategy="bogus")
        with pytest.raises(ValueError, match="unknown compressor"):
            make("nosuch")
    with pytest.raises(ValueError, match=r"'allgather' takes min_numel, got \['rank'\]"):
        gw_ddp.GradwireState("topk:ratio=0.1", strategy="allgather", rank=2)
    with pytest.raises(ValueError, match="takes no options"):
        GradientExchanger("fp16", backend=object(), strategy="allreduce", min_numel=3)
    with pytest.raises(ValueError, match=r"got \['rank'\]"):  # hierarchical: its own options and allgather's
        gw_ddp.GradwireState("topk:ratio=0.1", strategy="hierarchical", rank=2)
    with pytest.raises(ValueError, match="takes inner= one of"):
        gw_ddp.GradwireState("topk:ratio=0.1", strategy="hierarchical", inner="bogus")
    with pytest.raises(ValueError, match=r"got \['bogus_option'\]"):
        gw_fsdp.FSDPGradwireState("int8", bogus_option=1)
    with pytest.raises(ValueError, match="FSDP's reduce-scatter"):
        gw_ddp.GradwireState("int8", strategy="alltoall")
    with pytest.raises(ValueError, match="replicate_group"):
        gw_fsdp.FSDPGradwireState("int8", strategy="allgather")
    with pytest.raises(ValueError, match="does not apply to HSDP"):
        gw_fsdp.FSDPConfig("int8", "auto", hsdp=True)
    with pytest.raises(ValueError, match="bucket_mb"):
        ExchangerConfig("fp16", bucket_mb=0)


@pytest.mark.parametrize("config", [
    gw_ddp.DDPConfig(), gw_ddp.DDPConfig("topk:ratio=0.1", "hierarchical", inner="allgather", ranks_per_node=2,
                                         warmup=3, precondition="adam", seed=5),
    gw_ddp.DDPConfig("none", "powersgd", rank=2, start_iter=7), gw_fsdp.FSDPConfig(),
    gw_fsdp.FSDPConfig("none", "powersgd", hsdp=True, warm_start=False, rank=2, min_numel=3),
    ExchangerConfig(), ExchangerConfig("fp16", "allreduce", bucket_mb=2.0, per_tensor=False, seed=9),
    ExchangeConfig("qsgd:bits=4", "oktopk", error_feedback="off", boundary_every=8),
])
def test_get_config_is_plain_data_that_rebuilds_an_equal_config(config):
    data = config.get_config()
    again = pickle.loads(pickle.dumps(data))  # plain data
    rebuilt = type(config)(**again)
    assert rebuilt == config and rebuilt.fingerprint() == config.fingerprint()
    assert rebuilt.describe() == config.describe()
    assert config != ExchangeConfig("none", "dense")


def test_entry_points_rebuild_from_get_config():
    state = gw_ddp.GradwireState("topk:ratio=0.1", strategy="allgather", min_numel=4, warmup=2, seed=1)
    assert gw_ddp.GradwireState(**state.get_config()).fingerprint() == state.fingerprint()
    fsdp = gw_fsdp.FSDPGradwireState("qsgd:bits=4", min_numel=64, seed=3)
    data = {k: v for k, v in fsdp.get_config().items() if k != "hsdp"}  # (HSDP: pass replicate_group=)
    assert gw_fsdp.FSDPGradwireState(**data).fingerprint() == fsdp.fingerprint()


def test_state_is_keyword_only_in_register():
    for register in (gw_ddp.register, gw_fsdp.register):
        assert inspect.signature(register).parameters["state"].kind is inspect.Parameter.KEYWORD_ONLY
    with pytest.raises(TypeError):
        gw_ddp.register(object(), "fp16", gw_ddp.GradwireState("fp16"))  # type: ignore[misc]
    with pytest.raises(TypeError):
        gw_fsdp.register(object(), "int8", gw_fsdp.FSDPGradwireState("int8"))  # type: ignore[misc]


def test_saved_states_of_another_config_are_refused_clearly():
    saved = gw_ddp.GradwireState("topk:ratio=0.1", strategy="allgather").state_dict()
    with pytest.raises(ValueError, match="checkpoint was saved with .*topk:ratio=0.1.*this gradwire hook has .*fp16"):
        gw_ddp.GradwireState("fp16", strategy="allgather").load_state_dict(saved)
    options, saved_before = EXCHANGER_CONFIGS[1]
    config = ExchangerConfig(**options)
    config.check_saved({"config": saved_before})  # states without a fingerprint: their config decides
    with pytest.raises(ValueError, match="checkpoint was saved with .*this gradwire exchanger has"):
        config.check_saved({"config": EXCHANGER_CONFIGS[0][1]})


def test_a_ddp_state_pickled_before_the_config_object_unpickles():
    # the attributes a pickled GradwireState held before its settings moved into `config`
    old = {"preconditioner": None, "precondition": "", "warmup": 0, "warmup_ratio": 0.25, "_final": None,
           "_tuned": -1, "compressor": "topk:ratio=0.1", "strategy_name": "allgather", "error_feedback": True,
           "start_iter": 2, "seed": 0, "strategy_options": {}, "iter": 5, "last_stats": None, "history": [],
           "_param_sizes": None, "_param_shapes": None, "_pending_state": None}
    state = gw_ddp.GradwireState.__new__(gw_ddp.GradwireState)
    state.__setstate__(old)
    assert state.fingerprint() == 1127837264 and state.iter == 5 and state.strategy_name == "allgather"
    assert state.take_stats() == ExchangeStats()


def test_fsdp_stats_still_works_and_warns():
    state = gw_fsdp.FSDPGradwireState("int8")
    with pytest.warns(DeprecationWarning, match="take_stats"):
        assert state.stats == ExchangeStats()
    with pytest.warns(DeprecationWarning):
        state.stats = ExchangeStats(bytes_sent=3)
    assert state.take_stats().bytes_sent == 3 and state.take_stats().bytes_sent == 0


# ---- on real process groups -------------------------------------------------------------------
_ALIVE: list = []  # hierarchical's sub-groups outlive the rank's report (see tests/comm/test_hierarchical.py)


def _entry_points(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradwire.comm.torch_dist import TorchDistBackend

    out: dict = {}
    torch.manual_seed(0)
    # the seed reaches PowerSGD, whose error feedback is on, in every entry point
    ddp = DDP(nn.Linear(16, 8))
    state = gw_ddp.register(ddp, "none", strategy="powersgd", rank=2, seed=7)
    hier = gw_ddp.register(DDP(nn.Linear(16, 8)), "none", strategy="hierarchical", inner="powersgd",
                           ranks_per_node=1, seed=8)
    fsdp = gw_fsdp.FSDPGradwireState("none", strategy="powersgd", rank=2, seed=9,
                                     replicate_group=torch.distributed.group.WORLD)
    ex = GradientExchanger("none", backend=TorchDistBackend(), strategy="powersgd", rank=2, seed=10)
    out["powersgd"] = [(s.error_feedback, type(p).__name__, p.seed) for s, p in
                       ((state, state.strategy), (hier, hier.strategy.inner), (fsdp, fsdp._strategy),
                        (ex, ex.strategy))]
    _ALIVE.append(hier)
    # rejected at register, before anything runs
    for key, options in (("bogus", {"strategy": "bogus"}), ("option", {"strategy": "allgather", "rank": 2})):
        try:
            gw_ddp.register(DDP(nn.Linear(4, 4)), "topk:ratio=0.1", **options)
        except ValueError as e:
            out[key] = str(e)
    # last_stats with "step", take_stats() since the last call, everywhere
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    ddp2 = DDP(nn.Linear(16, 8))
    s2 = gw_ddp.register(ddp2, "fp16")
    for _ in range(3):
        ddp2(x).sum().backward()
    taken = s2.take_stats()
    out["ddp"] = (s2.last_stats["step"], s2.last_stats["iter"], taken.bytes_sent,
                  sum(h["bytes_sent"] for h in s2.history), s2.take_stats().bytes_sent)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8))
    fully_shard(model[0])
    fully_shard(model)
    s3 = gw_fsdp.register(model, "int8")
    for _ in range(2):
        model(x).sum().backward()
    # (the last step's record holds both FSDP groups' bytes; take_stats() both steps')
    out["fsdp"] = (s3.last_stats["step"], s3.last_stats["bytes_sent"] > 0,
                   s3.take_stats().bytes_sent == 2 * s3.last_stats["bytes_sent"], s3.take_stats().bytes_sent)
    ex2 = GradientExchanger("topk:ratio=0.5", backend=TorchDistBackend())
    grads = [torch.randn(64), torch.randn(32)]
    for _ in range(2):
        last = ex2.exchange_(grads)
    out["exchanger"] = (last["step"], ex2.last_stats is last, ex2.take_stats().bytes_sent == ex2.totals.bytes_sent,
                        ex2.take_stats().bytes_sent)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["config()"] = ex2.config() == ex2.get_config()
    out["config() warns"] = [w.category.__name__ for w in caught]
    return out


def test_entry_points_share_rules_and_api_on_real_groups():
    for r in run_ranks(_entry_points, 2, timeout=300):
        assert r["powersgd"] == [(True, "PowerSGD", 7), (True, "PowerSGD", 8), (True, "PowerSGD", 9),
                                 (True, "PowerSGD", 10)]
        assert "unknown strategy 'bogus'" in r["bogus"] and "allgather" in r["bogus"] and "powersgd" in r["bogus"]
        assert "takes min_numel" in r["option"] and "'rank'" in r["option"]
        step, iter_, taken, history_total, again = r["ddp"]
        assert step == iter_ == 2 and taken == history_total > 0 and again == 0
        assert r["fsdp"] == (1, True, True, 0)
        assert r["exchanger"] == (1, True, True, 0)
        assert r["config()"] is True and r["config() warns"] == ["DeprecationWarning"]


def test_register_names_what_to_wrap_when_the_model_is_not_ddp() -> None:
    """A bare module (no DDP around it) is refused at register with what to do, not an AttributeError."""
    with pytest.raises(TypeError, match=r"DistributedDataParallel.*got a Linear.*fsdp.register"):
        gw_ddp.register(nn.Linear(2, 2), "topk:ratio=0.5")


def test_one_method_string_means_the_same_at_every_entry_point() -> None:
    """"powersgd:rank=8" and "topk:ratio=0.01@allgather" are what `gradwire experiment` takes; the hooks
    and GradientExchanger take the same strings, equal to the keyword form (fingerprints included)."""
    as_string, as_keywords = gw_ddp.GradwireState("powersgd:rank=8"), gw_ddp.GradwireState("none", "powersgd", rank=8)
    assert as_string.get_config() == as_keywords.get_config() and as_string.fingerprint() == as_keywords.fingerprint()
    assert as_string.get_config()["strategy_options"] == {"rank": 8}
    assert ExchangerConfig("topk:ratio=0.01@allgather") == ExchangerConfig("topk:ratio=0.01", "allgather")
    auto = gw_ddp.GradwireState("powersgd:rank=8@auto")
    assert (auto.strategy_name, auto.strategy_options) == ("auto", {"inner": "powersgd", "rank": 8})
    assert FSDPConfig("powersgd:rank=4", hsdp=True).strategy == "powersgd"
    assert FSDPConfig("int8@alltoall") == FSDPConfig("int8")
    method = parse_method("powersgd:rank=8@auto")
    assert (method.compressor, method.strategy, method.options) == ("none", "auto", {"inner": "powersgd", "rank": 8})


def test_a_method_string_that_contradicts_the_keywords_is_refused() -> None:
    with pytest.raises(ValueError, match=r"names strategy 'allgather', and strategy='oktopk' was given"):
        gw_ddp.GradwireState("topk:ratio=0.01@allgather", strategy="oktopk")
    with pytest.raises(ValueError, match=r"options \['rank'\] differ between the method string and the keywords"):
        gw_ddp.GradwireState("powersgd:rank=8", rank=4)
    with pytest.raises(ValueError, match=r"strategy 'powersgd' takes .*rank.*got \['rnk'\]"):
        gw_ddp.GradwireState("powersgd:rnk=8")
    with pytest.raises(ValueError, match=r"unknown strategy 'bogus' in 'topk:ratio=0.1@bogus'; valid: "):
        gw_ddp.GradwireState("topk:ratio=0.1@bogus")
    with pytest.raises(ValueError, match=r"powersgd runs on its own .* not @allgather"):
        gw_ddp.GradwireState("powersgd:rank=2@allgather")
    with pytest.raises(ValueError, match=r"FSDP's reduce-scatter is compressed by the 'alltoall' exchange only"):
        FSDPConfig("powersgd:rank=4")
    with pytest.raises(ValueError, match=r"unknown compressor 'bogus'; valid names"):
        ExchangeConfig("bogus", "allgather")
