"""An emulated CUDA device for torch on a CPU-only build: tensors that say `cuda:0` (so the
compressors take their CUDA dispatch paths) and keep their bytes in CPU memory.

Inside `EmulatedDevice()`, a torch dispatch mode runs every op on the CPU tensors behind
the wrappers and wraps the results again; factories asked for `cuda` allocate on the CPU
(uninitialised ones are filled with a poison byte, as fresh device memory holds garbage),
and kernel launches go to the emulator (launcher.py, plugged into gradwire/cuda/launch.py)
with the same grids and arguments as on a GPU. Device-to-host transfers (`.cpu()`, `.item()`, copies into host
tensors) are counted in `host_reads`: the emulated counterpart of torch's sync debug mode;
device allocations can be listed (`count_allocations`), to show a step makes no full-size one.
What it does not model: streams (everything runs in program order) and pinned memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from gradwire.cuda import launch, loader

from .build import guard_library
from .launcher import EmulatorLauncher
from .module import Schedule

DEVICE = torch.device("cuda", 0)
_POISON = 0xA5
_ALLOC = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
          torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default,
          torch.ops.aten.empty_like.default}
_HOST_READS = {torch.ops.aten._local_scalar_dense.default}  # .item(), int(t): a host read


class EmuTensor(torch.Tensor):
    """A `cuda:0` tensor whose storage is the CPU tensor `host`."""

    host: torch.Tensor

    @staticmethod
    def __new__(cls, host: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(cls, host.shape, dtype=host.dtype, device=DEVICE,
                                                strides=host.stride(), storage_offset=host.storage_offset(),
                                                requires_grad=False)
        r.host = host
        return r

    def __repr__(self) -> str:
        return f"EmuTensor({self.host!r}, device='cuda:0')"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func}: an emulated CUDA tensor used outside EmulatedDevice()")


def host(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor holding an emulated tensor's bytes (a CPU tensor is itself)."""
    return t.host if isinstance(t, EmuTensor) else t


def _is_cuda(d: Any) -> bool:
    return d is not None and torch.device(d).type == "cuda"


class _Mode(TorchDispatchMode):
    def __init__(self, dev: "EmulatedDevice"):
        super().__init__()
        self.dev = dev

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        orig0 = args[0] if args else None
        wrapped: list[EmuTensor] = []

        def unwrap(a):
            if isinstance(a, EmuTensor):
                wrapped.append(a)
                return a.host
            return a

        args, kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        on_device = bool(wrapped)
        if "device" in kwargs:
            on_device = _is_cuda(kwargs["device"])
            if on_device:
                kwargs["device"] = torch.device("cpu")
        if func is torch.ops.aten._pin_memory.default or func is torch.ops.aten.pin_memory.default:
            return args[0]
        if func is torch.ops.aten.is_pinned.default:
            return False
        plain = {id(a) for a in args if isinstance(a, torch.Tensor)}  # host-side inputs as given
        if func is torch.ops.aten.copy_.default and id(args[0]) in plain and not isinstance(orig0, EmuTensor):
            on_device = False  # into a host tensor
        if wrapped and (func in _HOST_READS or not on_device):
            self.dev.host_reads += 1  # a device-to-host transfer: a sync on a GPU
        out = func(*args, **kwargs)
        if func in _ALLOC and on_device and out.numel() and out.is_contiguous():
            out.view(-1).view(torch.uint8).fill_(_POISON)
        if not on_device:
            return out
        if self.dev.allocations is not None:
            self.dev.allocations.extend(_fresh(args, kwargs, out))
        by_host = {id(w.host): w for w in wrapped}

        def wrap(o):
            if isinstance(o, torch.Tensor) and not isinstance(o, EmuTensor):
                if id(o) in by_host:
                    return by_host[id(o)]
                return EmuTensor(o)
            return o

        return tree_map(wrap, out)


def _fresh(args, kwargs, out) -> list[int]:
    """Bytes of each storage among an op's outputs that none of its inputs had: what it allocated."""
    from torch.utils._pytree import tree_leaves

    given = {a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
    sizes, seen = [], set()
    for o in tree_leaves(out):
        if isinstance(o, torch.Tensor) and not isinstance(o, EmuTensor):
            ptr = o.untyped_storage().data_ptr()
            if ptr not in given and ptr not in seen and o.untyped_storage().nbytes():
                seen.add(ptr)
                sizes.append(o.untyped_storage().nbytes())
    return sizes


@functools.lru_cache(maxsize=None)
def _register_guard() -> None:
    """torch's Python bindings put a device guard around ops on CUDA tensors; a CPU build has
    no CUDA guard, so a one-device stand-in is registered (never on a build with CUDA)."""
    if torch.backends.cuda.is_built():
        raise RuntimeError("the emulated CUDA device is for CPU-only torch builds")
    ctypes.CDLL(str(guard_library()), mode=ctypes.RTLD_GLOBAL).gw_register_cuda_guard()


class EmulatedDevice:
    """Context: an emulated `cuda:0` (tensors, `.cuda()`, kernel launches) on this thread.

    `schedule` orders threads and blocks in every launch; `source` overrides kernel texts
    (the mutation check); `sms` sets the grid cap (32 blocks per SM)."""

    def __init__(self, schedule: Schedule | str = "lowest", source=None, sms: int = 2, tsan: bool = False):
        self.schedule = Schedule.parse(schedule) if isinstance(schedule, str) else schedule
        if source is None and os.environ.get("GRADWIRE_EMULATOR_KERNELS"):  # a planted copy (mutations.py)
            kernel_dir = Path(os.environ["GRADWIRE_EMULATOR_KERNELS"])
            source = functools.partial(loader.source, kernel_dir=kernel_dir)
        kw = {} if source is None else {"source": source}
        self.launcher = EmulatorLauncher(self.schedule, sms=sms, host=host, tsan=tsan, **kw)
        self.host_reads = 0
        self.allocations: list[int] | None = None  # bytes of each device allocation, while counted
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "EmulatedDevice":
        _register_guard()
        st = self._stack
        st.enter_context(launch.emulated(self.launcher))
        st.enter_context(_patched(torch.cuda, "_lazy_init", lambda: None))
        st.enter_context(_patched(torch.Tensor, "cuda", _to_device))
        st.enter_context(_patched(torch.cuda, "synchronize", lambda device=None: None))
        tolist = torch.Tensor.tolist
        st.enter_context(_patched(torch.Tensor, "tolist",
                                  lambda t: tolist(t.cpu()) if isinstance(t, EmuTensor) else tolist(t)))
        st.enter_context(_Mode(self))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    @contextlib.contextmanager
    def count_host_reads(self) -> Iterator[list[int]]:
        """Yields a one-element list that holds, after the block, its device-to-host transfers."""
        start = self.host_reads
        box = [0]
        try:
            yield box
        finally:
            box[0] = self.host_reads - start


    @contextlib.contextmanager
    def count_allocations(self) -> Iterator[list[int]]:
        """Yields a list that collects the bytes of every device allocation made in the block
        (fresh storages of ops and factories; kernels allocate nothing themselves)."""
        prev, self.allocations = self.allocations, []
        box = self.allocations
        try:
            yield box
        finally:
            self.allocations = prev


def _to_device(self: torch.Tensor, device=None, non_blocking: bool = False, **_: Any) -> torch.Tensor:
    return self.to(DEVICE)


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)
