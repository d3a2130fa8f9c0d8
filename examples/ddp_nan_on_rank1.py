"""A DDP training loop in which rank 1 alone makes a nan at step 3, guarded by the sentinel.

    torchrun --nproc_per_node 2 examples/ddp_nan_on_rank1.py            # 2 CPU processes, gloo
    torchrun --nproc_per_node 2 examples/ddp_nan_on_rank1.py --backward # the nan made in backward

Both ranks stop at step 3 with a report: rank 1 names the module that made the nan; rank 0
says it received it from rank 1 through the gradient all-reduce. Neither waits for the other.
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import torch.distributed as dist
from torch import nn

from numguard_nb import Guard, NonFiniteError

BAD_STEP = 3


class SafeSqrt(nn.Module):
    """sqrt where positive, else 0: finite in forward, but in backward the branch not taken (sqrt
    of a negative) gives nan * 0 = nan (pytorch/pytorch#68425)."""

    def forward(self, x):
        return torch.where(x > 0, torch.sqrt(x), torch.zeros_like(x))


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)  # nan where x is negative


class Net(nn.Module):
    def __init__(self, backward: bool):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)  # buffers: DDP broadcasts them at every forward
        self.head = nn.Linear(16, 1)
        self.gate = nn.Linear(8, 1)
        self.scale = SafeSqrt() if backward else Log()

    def forward(self, x):
        gate = self.scale(self.gate(x) + 10)  # + 10: positive for the data seen in training
        return self.head(torch.relu(self.norm(self.embed(x)))) * gate


def bad_batch(model: nn.Module) -> torch.Tensor:
    """A batch that drives the gate far below -10 (rank 1's, at the bad step)."""
    weight = model.module.gate.weight[0].detach()
    noise = torch.randn(32, 8, generator=torch.Generator().manual_seed(7))
    return -100 * torch.sign(weight) + noise


def say(line: str) -> None:
    """One write per line: both ranks stop at the same step and print at once, and `print` writes
    the text and its newline apart (unbuffered, as under `python -u`), which can mix the lines."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backward", action="store_true",
                        help="make the nan in backward (torch.where over a sqrt) instead of in "
                             "forward (a log)")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Net(args.backward))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        with Guard(model, mode="sentinel"):
            for step in range(6):
                x = torch.randn(32, 8, generator=torch.Generator().manual_seed(100 * step + rank))
                if rank == 1 and step == BAD_STEP:
                    x = bad_batch(model)
                loss = model(x).pow(2).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        say(f"rank {rank}: finished with no detection")
        return 0
    except NonFiniteError as error:
        say(f"rank {rank}: {error.report.summary()}")
        return 0
    finally:
        dist.barrier()  # both ranks stopped at the same step: tear down together
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
