"""The sentinel's extra time on the 194-module stack with the loss computed in the model's forward
or outside it (three functions: `.float().pow(2).mean()`), with and without DDP (one process);
each configuration in pairs with its unguarded twin, in alternating order.

    python benchmarks/sentinel_where.py                  # CUDA and nccl where there is a GPU
    python benchmarks/sentinel_where.py --device cpu     # gloo, a small stack (width 32)

On an NVIDIA H200 (2026-11-27) the loss outside the model cost the sentinel +5 ms a step more than
inside it (1.34x against 1.09x), with DDP or without: that, not DDP, is what
`ddp_overhead.py --backend nccl`'s 1.26x measures (its loss is outside the model). (The loss
code's rows were then made anew each step; they are given back since.)
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics

import torch
import torch.distributed as dist
from torch import nn

from ddp_overhead import squared_mean, stack_model, timed_step
from numguard_nb import Guard


class LossInside(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x):
        return squared_mean(self.body(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    device = torch.device(args.device)
    width, batch = (1024, 256) if device.type == "cuda" else (32, 8)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    x = torch.randn(batch, width, device=device)
    optimizer_options = {"fused": True} if device.type == "cuda" else {}
    try:
        for ddp in (False, True):
            for outside in (False, True):
                torch.manual_seed(0)
                body = stack_model(width, 48).to(device)
                base = body if outside else LossInside(body)
                models = [base, copy.deepcopy(base)]
                if ddp:
                    models = [nn.parallel.DistributedDataParallel(m) for m in models]
                optimizers = [torch.optim.AdamW(m.parameters(), lr=0.0, **optimizer_options)
                              for m in models]
                guard = Guard(models[1], mode="sentinel").attach()
                times: list = [[], []]
                for i in range(args.steps + 5):
                    for which in ((0, 1) if i % 2 else (1, 0)):
                        elapsed = timed_step(models[which], optimizers[which], x, device,
                                             squared_mean if outside else (lambda loss: loss),
                                             autocast=True)
                        if i >= 5:
                            times[which].append(elapsed)
                guard.detach()
                ratio = statistics.median(g / p for p, g in zip(*times))
                extra = statistics.median(g - p for p, g in zip(*times)) * 1e3
                print(f"ddp={ddp!s:5} loss {'outside' if outside else 'inside '}: unguarded "
                      f"{statistics.median(times[0]) * 1e3:.1f} ms, sentinel +{extra:.2f} ms "
                      f"({ratio:.3f}x)", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
