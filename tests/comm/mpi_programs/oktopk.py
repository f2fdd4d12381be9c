"""The `oktopk` sparse allreduce over MPI: the checks of tests/support/oktopk_checks.py, which the gloo
tests run too.  mpiexec -n 8 python tests/comm/mpi_programs/oktopk.py"""

from __future__ import annotations

import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(here)), "support"))
from _harness import check, main  # noqa: E402

import oktopk_checks as checks  # noqa: E402


@check
def matches_the_dense_oracle(b) -> None:
    checks.matches_the_dense_oracle(b)


@check
def bytes_stay_within_6k_pairs(b) -> None:
    checks.bytes_stay_within_6k_pairs(b)


@check
def empty_and_all_selected_ranks_work(b) -> None:
    checks.empty_and_all_selected_ranks_work(b)


@check
def nonfinite_reaches_every_rank(b) -> None:
    checks.nonfinite_reaches_every_rank(b)


@check
def error_feedback_keeps_what_was_not_sent(b) -> None:
    checks.error_feedback_keeps_what_was_not_sent(b)


@check
def hostile_chunk_fails_every_rank(b) -> None:
    checks.hostile_chunk_fails_every_rank(b)


if __name__ == "__main__":
    main(__name__)
