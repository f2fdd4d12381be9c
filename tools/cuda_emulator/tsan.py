"""ThreadSanitizer pass: replay emulated launches in a TSan build, to find races no schedule shows.

The fiber scheduler runs each thread until it blocks, so a non-atomic read-modify-write
of shared memory never interleaves with another thread's. Under TSan every fiber is a
TSan fiber, switches carry no ordering, and the only orderings are the launch, the
`__syncthreads` barriers and `__syncwarp`: two fibers touching one address (one of them
writing, not atomically) without one of those in between is reported, whatever the order.

TSan's runtime has to start with its process, so the TSan build of a kernel file runs in
`tsan_host` (tsan_host.cpp), which gets each launch's inputs over a pipe. Limits: races
between blocks are not seen (blocks run one after another); shuffles are not orderings.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import os
import struct
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from . import build as _build
from .module import POLICIES, EmulatorError, Schedule

HOST = Path(__file__).with_name("tsan_host.cpp")


def available() -> bool:
    """g++ can build and run a ThreadSanitizer program here."""
    try:
        _host_binary()
    except Exception:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _host_binary() -> Path:
    cxx = _build.compiler()
    if cxx is None:
        raise RuntimeError("the CUDA emulator needs g++ on x86-64 Linux")
    flags = ["-std=c++17", "-O1", "-fsanitize=thread", "-pie", "-fPIE"]
    h = hashlib.sha256("\0".join([HOST.read_text(), *flags, _build._compiler_id(cxx)]).encode()).hexdigest()[:20]
    out = _build.cache_dir() / f"tsan_host-{h}"
    if not out.exists():
        with tempfile.TemporaryDirectory(dir=_build.cache_dir()) as tmp:
            exe = Path(tmp) / "tsan_host"
            res = subprocess.run([cxx, *flags, str(HOST), "-ldl", "-o", str(exe)], capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"tsan_host build failed:\n{res.stderr[-4000:]}")
            os.replace(exe, out)
    return out


class TsanHost:
    """One tsan_host process per kernel text; `replay` runs one launch and returns its TSan report."""

    def __init__(self, stem: str, text: str, names: tuple[str, ...]):
        self.names = names
        lib = _build.build(stem, text, names, tsan=True)
        self._log = tempfile.TemporaryFile()
        env = dict(os.environ, TSAN_OPTIONS="halt_on_error=0 report_signal_unsafe=0 history_size=2")
        self._proc = subprocess.Popen([str(_host_binary()), str(lib)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._log, env=env)
        self._lock = threading.Lock()
        atexit.register(self.close)

    def replay(self, name: str, grid, block, args: tuple, schedule: Schedule) -> tuple[int, str, str]:
        """(races, TSan's report text, the launch's own error)."""
        g = tuple(grid) if not isinstance(grid, int) else (grid, 1, 1)
        b = tuple(block) if not isinstance(block, int) else (block, 1, 1)
        g, b = g + (1,) * (3 - len(g)), b + (1,) * (3 - len(b))
        msg = [b"GWL1", struct.pack("<I3I3IiiQ3BI", self.names.index(name), *g, *b, POLICIES[schedule.policy],
                                    int(schedule.policy == "random" if schedule.split is None else schedule.split),
                                    schedule.seed & (2**64 - 1), 0xFF, 0xA5, 0x00, len(args))]
        for a in args:
            if isinstance(a, torch.Tensor):
                data = ctypes.string_at(a.data_ptr(), a.numel() * a.element_size()) if a.numel() else b""
                msg.append(struct.pack("<BQ", 0, len(data)) + data)
            else:
                data = np.array(a).tobytes()
                msg.append(struct.pack("<BQ", 1, len(data)) + data)
        with self._lock:
            start = self._log.seek(0, os.SEEK_END)
            self._proc.stdin.write(b"".join(msg))
            self._proc.stdin.flush()
            head = self._proc.stdout.read(12)
            if len(head) != 12:
                self._log.seek(start)
                raise EmulatorError(f"tsan_host died: {self._log.read().decode(errors='replace')[-3000:]}")
            rc, races, n = struct.unpack("<iII", head)
            err = self._proc.stdout.read(n).decode(errors="replace")
            self._log.seek(start)
            report = self._log.read().decode(errors="replace")
        return races, report, err if rc else ""

    def close(self) -> None:
        """End the host (it exits at the end of its input)."""
        if self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(timeout=30)
        self._proc.stdout.close()
        self._log.close()


@functools.lru_cache(maxsize=None)
def host(stem: str, text: str, names: tuple[str, ...]) -> TsanHost:
    return TsanHost(stem, text, names)
