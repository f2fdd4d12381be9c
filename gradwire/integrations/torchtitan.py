"""torchtitan: gradwire's FSDP hook on the model a torchtitan `parallelize_fn` returns.

torchtitan applies FSDP2 inside each model's `parallelize_fn` (a field of its `ModelSpec`), so the
hook goes in there: `compressed` wraps a `parallelize_fn`, calls it, then registers
`gradwire.hooks.fsdp` on what it returns. Put it into a config function of your own and point
torchtitan at it:

    # my_titan.py:  torchrun --nproc_per_node 8 -m torchtitan.train --module my_titan --config llama3_int8
    import dataclasses
    from torchtitan.models.llama3.config_registry import llama3_8b
    from gradwire.integrations.torchtitan import compressed

    def llama3_int8():
        config = llama3_8b()
        spec = config.model_spec
        config.model_spec = dataclasses.replace(spec, parallelize_fn=compressed(spec.parallelize_fn, "int8"))
        return config

What it does to the FSDP modules: torchtitan sums gradients over the data-parallel ranks
(`set_gradient_divide_factor(1.0)`; the trainer divides the loss by the global token count), which
FSDP2 asks of its reduce-scatter as `ReduceOp.PREMUL_SUM`, an op gradwire's reduce-scatter (and
gloo) does not take. `compressed` turns on FSDP's `set_force_sum_reduction_for_comms(True)`, so the
reduce-scatter is asked for a plain SUM and FSDP applies any divide factor itself, before or after:
for torchtitan's factor 1.0 the same sum as before (`"none"` gives the uncompressed run bit for bit).

Supported: FSDP over torchtitan's "fsdp" mesh (data_parallel_shard_degree x context_parallel_degree),
one gradwire state per model part (pipeline parallelism calls `parallelize_fn` once per stage), in
`.states`. With no sharded data parallelism there is nothing to compress and nothing is
registered. HSDP (data_parallel_replicate_degree > 1) raises NotImplementedError before
parallelizing: torchtitan gives `fully_shard` a mesh with a "dp_replicate" dimension (FSDP's
native HSDP), whose cross-replica all-reduce is FSDP's own, dense, and runs before any hook; and
gradwire's own cross-replica exchange (`replicate_group=`, for `fully_shard` on the shard dimension
only) averages over the replicas where torchtitan sums. torchtitan's checkpoints do not hold the
hook's state: error-feedback residuals (on for "int8") restart at zero on resume.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

try:
    from torchtitan.distributed import ParallelDims
except ImportError as exc:  # an optional extra
    raise ImportError('gradwire.integrations.torchtitan needs torchtitan: pip install "gradwire[torchtitan]"') from exc

from ..compress import Compressor
from ..hooks import fsdp as fsdp_hooks
from ..hooks.fsdp import DEFAULT_COMPRESSOR, FSDPGradwireState

__all__ = ["CompressedParallelize", "compressed"]

_CHOSEN_HERE = ("replicate_group", "state")


class CompressedParallelize:
    """A torchtitan `parallelize_fn` that calls `parallelize_fn` and registers gradwire's FSDP
    hook on its result. `states` holds one `FSDPGradwireState` per model part it parallelized."""

    def __init__(self, parallelize_fn: Callable[..., nn.Module], compressor: Compressor | str = DEFAULT_COMPRESSOR,
                 **options: Any) -> None:
        taken = [name for name in _CHOSEN_HERE if name in options]
        if taken:
            raise ValueError(f"compressed() chooses {', '.join(taken)} itself; drop it from the options")
        FSDPGradwireState(compressor, **options)  # bad specs, strategies and options raise ValueError now
        self.parallelize_fn = parallelize_fn
        self.compressor = compressor
        self.options = options
        self.states: list[FSDPGradwireState] = []

    @property
    def state(self) -> FSDPGradwireState:
        """The state of the one model part (no pipeline parallelism)."""
        if not self.states:
            raise ValueError("no gradwire state: this parallelize_fn has not run yet, or found no sharded data "
                             "parallelism to compress")
        if len(self.states) > 1:
            raise ValueError(f"{len(self.states)} model parts have a gradwire state each; use .states")
        return self.states[0]

    def __call__(self, model: nn.Module, *, parallel_dims: ParallelDims, **kwargs: Any) -> nn.Module:
        if parallel_dims.dp_replicate_enabled:
            raise NotImplementedError(
                "gradwire's torchtitan recipe supports FSDP only, not HSDP (data_parallel_replicate_degree="
                f"{parallel_dims.dp_replicate}): torchtitan gives fully_shard a mesh with a 'dp_replicate' dimension, "
                "and FSDP's native HSDP all-reduces across replicas densely before any hook runs; gradwire's own "
                "cross-replica exchange (replicate_group=) averages where torchtitan sums the gradients. Set "
                "data_parallel_replicate_degree=1 to shard over all data-parallel ranks")
        model = self.parallelize_fn(model, parallel_dims=parallel_dims, **kwargs)
        if not parallel_dims.fsdp_enabled:
            return model  # one rank per fsdp group: FSDP reduce-scatters nothing
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        self.states.append(fsdp_hooks.register(model, self.compressor, **self.options))
        return model

    def __deepcopy__(self, memo: dict[int, Any]) -> CompressedParallelize:
        # torchtitan deep-copies configs (its Config.to_dict runs dataclasses.asdict on the ModelSpec): every
        # copy stays this one object, so `states` is the list the trainer's model parts fill
        return self

    def __repr__(self) -> str:
        name = getattr(self.parallelize_fn, "__qualname__", repr(self.parallelize_fn))
        return f"compressed({name}, {self.compressor!r})"


def compressed(parallelize_fn: Callable[..., nn.Module], compressor: Compressor | str = DEFAULT_COMPRESSOR,
               **options: Any) -> CompressedParallelize:
    """`parallelize_fn` with gradwire's FSDP hook: put it in a `ModelSpec` in place of the original.
    `options` are `gradwire.hooks.fsdp.register`'s (strategy, error_feedback, seed, min_numel, ...);
    bad ones raise ValueError here."""
    return CompressedParallelize(parallelize_fn, compressor, **options)
