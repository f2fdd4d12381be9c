"""Deprecated: renamed `gradwire.comm.sparse_exchange` (it is an exchange of index/value pairs, not
the sparse compressors of gradwire.compress.sparse). This shim re-exports it for one release."""

import warnings

from .sparse_exchange import (check_indices, merge_dense, merge_sparse, pack, packed_size, sparse_allgather,
                              unpack)

warnings.warn("gradwire.comm.sparse is renamed gradwire.comm.sparse_exchange; this alias goes in the next release",
              DeprecationWarning, stacklevel=2)

__all__ = ["check_indices", "merge_dense", "merge_sparse", "pack", "packed_size", "sparse_allgather", "unpack"]
