"""Run the checks of several programs in one mpiexec job (one start-up for all of them).

    mpiexec -n 4 python tests/comm/mpi_programs/run.py collectives sparse_exchange train
"""

from __future__ import annotations

import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness  # noqa: E402

if __name__ == "__main__":
    checks = []
    for name in sys.argv[1:] or ["collectives", "sparse_exchange", "train"]:
        module = importlib.import_module(name)
        checks += _harness.REGISTRY[module.__name__]
    _harness.run(checks)
