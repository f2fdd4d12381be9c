"""Training tasks: data generated or read locally (nothing is downloaded) and their models.

- `mnist1d`: the MNIST-1D benchmark, generated with the `mnist1d` package's own generator
  (10,000 samples, 40 features), cached as .npz; a small 1-D CNN, or an MLP whose hidden
  width `--width` sets how communication-heavy the run is.
- `charlm`: a character-level transformer language model on the text of Python's own
  documentation (`pydoc_data.topics`, shipped with CPython).
- `cifar10`: ResNet-20 on CIFAR-10 from a local `cifar-10-batches-py` folder (`--data-dir`).
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn
import torch.nn.functional as F


@dataclass
class Dataset:
    """Tensors of one task; `x`/`y` are the training split, `x_test`/`y_test` the held-out one."""

    x: torch.Tensor
    y: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


@dataclass(frozen=True)
class Tuned:
    """A task's default hook settings for compressed methods (the `auto` of --precondition, --warmup and
    --start-iter); docs/benchmarks.md has the ablation behind the charlm ones."""

    precondition: str = ""  # sparsifiers: "adam" sends Adam's direction, the optimizer is plain SGD
    warmup: int = 0  # sparsifiers: DGC density warm-up steps (25% -> the ratio)
    powersgd_start: int = -1  # PowerSGD: dense steps before it starts (-1: the hook's 2)
    # sparsifiers with the task's precondition and its own lr: lr x sqrt(world). Each rank's moments see
    # its own batch's noise, W times the global batch's, so where noise dominates the averaged direction
    # is about sqrt(W) shorter than Adam's on the averaged gradient
    sqrt_world_lr: bool = False


@dataclass(frozen=True)
class Task:
    name: str
    metric: str  # "accuracy" (classification) or "perplexity" (language model; accuracy is next-char)
    load: Callable[[Path | None, Path], Dataset]
    model: Callable[[str, int], nn.Module]  # (architecture, width) -> module
    default_arch: str
    default_lr: float
    default_batch: int  # per rank
    optimizer: str = "sgd"  # "sgd" (momentum 0.9) or "adam"
    tuned: Tuned = Tuned()  # hook settings its compressed methods get by default


# ---- mnist1d ---------------------------------------------------------------------------
MNIST1D_SAMPLES = 10_000
MNIST1D_SEED = 42


def load_mnist1d(data_dir: Path | None, cache_dir: Path) -> Dataset:
    """Generate MNIST-1D locally (the package's generator, fixed seed) and cache it."""
    path = cache_dir / f"mnist1d_{MNIST1D_SAMPLES}_{MNIST1D_SEED}.npz"
    if not path.exists():
        try:
            from mnist1d.data import get_dataset_args, make_dataset
        except ImportError as exc:
            raise RuntimeError("the mnist1d task needs the mnist1d package: pip install 'gradwire[experiments]'") from exc
        args = get_dataset_args()
        args.num_samples = MNIST1D_SAMPLES
        args.seed = MNIST1D_SEED
        data = make_dataset(args)
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, x=data["x"], y=data["y"], x_test=data["x_test"], y_test=data["y_test"])
        tmp.replace(path)
    with np.load(path) as d:
        return Dataset(torch.tensor(d["x"], dtype=torch.float32), torch.tensor(d["y"], dtype=torch.long),
                       torch.tensor(d["x_test"], dtype=torch.float32), torch.tensor(d["y_test"], dtype=torch.long))


class ConvNet1D(nn.Module):
    """A 1-D CNN for MNIST-1D (about 94-95% test accuracy when trained to convergence)."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv1d(1, width, 5, padding=2), nn.ReLU(),
            nn.Conv1d(width, width, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv1d(width, width, 3, stride=2, padding=1), nn.ReLU())
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(width * 10, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x.unsqueeze(1)))


def mlp(inputs: int, width: int, classes: int) -> nn.Module:
    return nn.Sequential(nn.Linear(inputs, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, classes))


def mnist1d_model(arch: str, width: int) -> nn.Module:
    if arch == "cnn":
        return ConvNet1D(width or 64)
    if arch == "mlp":
        return mlp(40, width or 512, 10)
    raise ValueError(f"mnist1d: unknown arch {arch!r}; valid: cnn, mlp")


# ---- char-level LM -----------------------------------------------------------------------
CHARLM_CONTEXT = 64


def load_charlm(data_dir: Path | None, cache_dir: Path) -> Dataset:
    """Python's documentation text, as byte-level windows: 90% train / 10% test by position."""
    import pydoc_data.topics as topics

    text = "\n".join(topics.topics[k] for k in sorted(topics.topics)).encode("utf-8")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    split = int(len(data) * 0.9)
    train, test = data[:split], data[split:]

    def windows(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = (len(d) - 1) // CHARLM_CONTEXT
        x = d[: n * CHARLM_CONTEXT].view(n, CHARLM_CONTEXT)
        y = d[1: n * CHARLM_CONTEXT + 1].view(n, CHARLM_CONTEXT)
        return x, y

    x, y = windows(train)
    xt, yt = windows(test)
    return Dataset(x, y, xt, yt)


class CharTransformer(nn.Module):
    """A small causal transformer over bytes (vocabulary 256)."""

    def __init__(self, width: int = 128, layers: int = 2, heads: int = 4, context: int = CHARLM_CONTEXT) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.randn(context, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.embed(x) + self.position[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.out(self.norm(h))


#: charlm's architectures: (default width, layers, heads). `gpt` is the larger LM of the outer-loop
#: runs (about 4.8M parameters at width 256), the same blocks six deep.
CHARLM_ARCHS = {"transformer": (128, 2, 4), "gpt": (256, 6, 8)}


def charlm_model(arch: str, width: int) -> nn.Module:
    if arch not in CHARLM_ARCHS:
        raise ValueError(f"charlm: unknown arch {arch!r}; valid: {', '.join(CHARLM_ARCHS)}")
    default, layers, heads = CHARLM_ARCHS[arch]
    return CharTransformer(width or default, layers, heads)


# ---- CIFAR-10 ------------------------------------------------------------------------------
CIFAR_MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
CIFAR_STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)


def load_cifar10(data_dir: Path | None, cache_dir: Path) -> Dataset:
    """Read the python-pickle CIFAR-10 release (`cifar-10-batches-py`) from `data_dir`."""
    if data_dir is None:
        raise ValueError("the cifar10 task reads a local copy: pass --data-dir pointing at cifar-10-batches-py "
                         "(nothing is downloaded at run time)")
    root = Path(data_dir)
    if (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    missing = [n for n in names if not (root / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{root} is not a cifar-10-batches-py folder: missing {', '.join(missing)}")

    def read(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        with open(root / name, "rb") as f:
            d = pickle.load(f, encoding="bytes")
        x = torch.tensor(np.asarray(d[b"data"], dtype=np.uint8)).view(-1, 3, 32, 32).float().div_(255)
        return (x - CIFAR_MEAN) / CIFAR_STD, torch.tensor(d[b"labels"], dtype=torch.long)

    parts = [read(n) for n in names[:5]]
    xt, yt = read(names[5])
    return Dataset(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), xt, yt)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))) + self.skip(x))


class ResNet20(nn.Module):
    """ResNet-20 for 32x32 images (He et al. 2016, section 4.2): 3 stages of 3 blocks."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        blocks: list[nn.Module] = []
        cin = width
        for stage, cout in enumerate((width, 2 * width, 4 * width)):
            for i in range(3):
                blocks.append(BasicBlock(cin, cout, 2 if stage and i == 0 else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(x))
        return self.head(h.mean(dim=(2, 3)))


def cifar10_model(arch: str, width: int) -> nn.Module:
    if arch != "resnet20":
        raise ValueError(f"cifar10: unknown arch {arch!r}; valid: resnet20")
    return ResNet20(width or 16)


CHARLM_TUNED = Tuned(precondition="adam", warmup=100, powersgd_start=40, sqrt_world_lr=True)
TASKS: dict[str, Task] = {
    "mnist1d": Task("mnist1d", "accuracy", load_mnist1d, mnist1d_model, "cnn", 0.05, 32),
    "charlm": Task("charlm", "perplexity", load_charlm, charlm_model, "transformer", 0.003, 16, "adam", CHARLM_TUNED),
    "cifar10": Task("cifar10", "accuracy", load_cifar10, cifar10_model, "resnet20", 0.05, 32),
}


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; valid: {', '.join(TASKS)}") from None


def digest(ds: Dataset) -> str:
    """Short fingerprint of a dataset, recorded with each run so results name their data."""
    h = hashlib.sha256()
    for t in (ds.x, ds.y, ds.x_test, ds.y_test):
        h.update(t.contiguous().numpy().tobytes()[:1 << 20])
        h.update(str(tuple(t.shape)).encode())
    return h.hexdigest()[:12]
