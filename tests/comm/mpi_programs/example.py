"""examples/mpi_train.py runs under MPI: the loss falls and the replicas stay identical.
mpiexec -n 2 python tests/comm/mpi_programs/example.py"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import check, main  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "mpi_train.py"


@check
def mpi_train_example(b) -> None:
    spec = importlib.util.spec_from_file_location("mpi_train_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    out = io.StringIO()
    # raw indices: index packing costs milliseconds a call on tensors this small
    argv, sys.argv = sys.argv, [str(EXAMPLE), "--steps", "40", "--compressor", "topk:ratio=0.01,indices=raw"]
    try:
        with contextlib.redirect_stdout(out):
            module.main()  # raises SystemExit(1) if the replicas differ
    finally:
        sys.argv = argv
    text = out.getvalue()
    if b.rank == 0:
        losses = [float(line.split()[3]) for line in text.splitlines() if line.startswith("step")]
        assert len(losses) == 2 and losses[-1] < losses[0] / 10, text
        assert "parameters identical" in text, text


if __name__ == "__main__":
    main(__name__)
