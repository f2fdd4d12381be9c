"""Exchanging compressed gradients: backends, strategies, the cost model, a plain-MPI API.

mpi4py is imported only when an `MPIBackend` is created.
"""

from .api import GradientExchanger
from .backend import Backend, Work
from .base import ExchangeStats, Strategy
from .links import CostModel
from .mpi import MPIBackend, mpi_cuda_aware
from .registry import make_strategy
from .sparse_exchange import merge_dense, merge_sparse, sparse_allgather

__all__ = ["Backend", "Work", "GradientExchanger", "MPIBackend", "mpi_cuda_aware", "sparse_allgather",
           "merge_dense", "merge_sparse", "CostModel", "make_strategy", "ExchangeStats", "Strategy"]
