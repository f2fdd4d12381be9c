"""Data-parallel training with mpi4py and gradwire's GradientExchanger.

    mpiexec -n 2 python examples/mpi_train.py
    mpiexec -n 4 python examples/mpi_train.py --compressor "topk:ratio=0.01+fp16" --steps 300

Each rank trains the same small MLP on its own shard of a synthetic regression task; after
every backward pass the exchanger replaces the gradients with their compressed average over
all ranks, so every rank takes the same optimizer step and the replicas stay bit-identical.
(With more ranks than cores, add ``--oversubscribe`` for Open MPI and set
OMPI_MCA_mpi_yield_when_idle=1.)
"""

from __future__ import annotations

import argparse
import hashlib

import torch
from mpi4py import MPI
from torch import nn

from gradwire.comm.api import GradientExchanger


def shard(rank: int, n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    teacher = torch.randn(32, 1, generator=torch.Generator().manual_seed(0))  # same on every rank
    g = torch.Generator().manual_seed(1 + rank)  # each rank's own samples
    x = torch.randn(n, 32, generator=g)
    y = torch.tanh(x @ teacher / 4) * 2 + 0.01 * torch.randn(n, 1, generator=g)
    return x, y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compressor", default="topk:ratio=0.01")
    ap.add_argument("--strategy", default="allgather", help="allgather, allreduce, artopk, dense or auto")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=0.3)
    ap.add_argument("--no-error-feedback", action="store_true")
    ap.add_argument("--checkpoint", help="at the end, each rank saves model, optimizer and exchanger state "
                                         "to CHECKPOINT.rank<r>.pt (error-feedback residuals are per rank)")
    args = ap.parse_args()

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)

    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    # backend defaults to MPIBackend(MPI.COMM_WORLD)
    ex = GradientExchanger(args.compressor, strategy=args.strategy,
                           error_feedback=not args.no_error_feedback, seed=0)
    ex.broadcast_(model.state_dict().values())  # every rank starts from rank 0's weights
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    x, y = shard(rank)

    for step in range(args.steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        stats = ex.exchange_(model.named_parameters())  # grads := compressed mean over ranks
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            mean_loss = comm.allreduce(loss.item()) / world
            if rank == 0:
                print(f"step {step:4d}  loss {mean_loss:.5f}  sent {stats['bytes_sent']} B "
                      f"(dense {stats['dense_bytes']} B, {stats['ratio']:.1f}x)", flush=True)

    # All replicas must be identical: compare a hash of the parameters.
    digest = hashlib.sha256(torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                            .numpy().tobytes()).hexdigest()[:16]
    digests = comm.allgather(digest)
    if rank == 0:
        t = ex.totals
        print(f"{world} ranks, parameters {'identical' if len(set(digests)) == 1 else 'DIFFER: ' + str(digests)}; "
              f"sent {t.bytes_sent} of {t.dense_bytes} dense bytes ({t.ratio:.1f}x) over {ex.step} steps")
    if args.checkpoint:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gradwire": ex.state_dict()},
                   f"{args.checkpoint}.rank{rank}.pt")
    if len(set(digests)) != 1:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
