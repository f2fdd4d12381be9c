"""Compile a kernel file's exact NVRTC text with g++ into a shared library, cached by content.

The unit is `runtime.h` (force-included), then the kernel text unmodified, then one pair of
C entry points per template instantiation (launch, parameter signature). The cache key
hashes all of it plus the compiler's version and flags, so a changed kernel, header or
runtime rebuilds. `-fno-gnu-unique -fvisibility=hidden`: GCC would otherwise emit the
template-local `__shared__` statics as STB_GNU_UNIQUE, and a second build of the same
source (a planted mutation, another schedule's TSan build) would share the first one's
shared memory even under RTLD_LOCAL.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

RUNTIME = Path(__file__).with_name("runtime.h")
FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-fno-gnu-unique", "-fvisibility=hidden",
         "-ffp-contract=off", "-fno-fast-math", "-fno-strict-aliasing", "-U_FORTIFY_SOURCE", "-w")
TSAN_FLAGS = ("-fsanitize=thread", "-DGW_TSAN=1", "-O1", "-g1")  # -g1: line tables for the reports


def compiler() -> str | None:
    """g++ on x86-64 Linux, else None (the emulator's context switch is x86-64 assembly)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    return os.environ.get("GRADWIRE_EMULATOR_CXX") or shutil.which("g++")


def available() -> bool:
    return compiler() is not None


@functools.lru_cache(maxsize=None)
def _compiler_id(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout


def cache_dir() -> Path:
    d = Path(os.environ.get("GRADWIRE_EMULATOR_CACHE", Path(tempfile.gettempdir()) / "gradwire-emulator"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def unit(text: str, names: tuple[str, ...]) -> str:
    """Kernel text plus its entry points: gw_launch_<i> and gw_sig_<i> for names[i]."""
    stubs = [f"\n// ---- emulator entry points (appended; the kernel text above is unmodified) ----"]
    for i, name in enumerate(names):
        stubs.append(f"GW_EXPORT int gw_launch_{i}(gw::Desc* d) {{ return gw::launch(&{name}, d); }}")
        stubs.append(f"GW_EXPORT const char* gw_sig_{i}() {{ static const std::string s = gw::signature(&{name}); "
                     f"return s.c_str(); }}")
    return text + "\n".join(stubs) + "\n"


def build(stem: str, text: str, names: tuple[str, ...], tsan: bool = False) -> Path:
    """The path of the compiled library (built on a cache miss)."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("the CUDA emulator needs g++ on x86-64 Linux")
    flags = FLAGS + (TSAN_FLAGS if tsan else ())
    src = unit(text, names)
    h = hashlib.sha256()
    for part in (RUNTIME.read_text(), src, " ".join(flags), _compiler_id(cxx)):
        h.update(part.encode())
        h.update(b"\0")
    out = cache_dir() / f"{stem}-{'tsan-' if tsan else ''}{h.hexdigest()[:20]}.so"
    if out.exists():
        return out
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        cpp = Path(tmp) / f"{stem}.cu.cpp"
        cpp.write_text(src)
        so = Path(tmp) / "out.so"
        res = subprocess.run([cxx, *flags, "-include", str(RUNTIME), str(cpp), "-o", str(so)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"emulator build of {stem} failed:\n{res.stderr[-6000:]}")
        os.replace(so, out)  # atomic: concurrent builders of one key agree
    return out


GUARD = Path(__file__).with_name("guard.cpp")


def guard_library() -> Path:
    """The CUDA device-guard stand-in (guard.cpp) built against the installed torch, cached."""
    import torch

    cxx = compiler()
    if cxx is None:
        raise RuntimeError("the CUDA emulator needs g++ on x86-64 Linux")
    root = Path(torch.__file__).parent
    flags = ["-std=c++17", "-O1", "-fPIC", "-shared", "-w",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", f"-I{root / 'include'}"]
    libs = [f"-L{root / 'lib'}", "-lc10", f"-Wl,-rpath,{root / 'lib'}"]
    h = hashlib.sha256("\0".join([GUARD.read_text(), torch.__version__, str(root), *flags, _compiler_id(cxx)]).encode())
    out = cache_dir() / f"guard-{h.hexdigest()[:20]}.so"
    if not out.exists():
        with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
            so = Path(tmp) / "guard.so"
            res = subprocess.run([cxx, *flags, str(GUARD), *libs, "-o", str(so)], capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"emulator device guard build failed:\n{res.stderr[-4000:]}")
            os.replace(so, out)
    return out
