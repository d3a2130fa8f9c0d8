"""A DistributedDataParallel training step with the sentinel against none, interleaved.

    python benchmarks/ddp_overhead.py                      # 2 processes over gloo, CPU
    python benchmarks/ddp_overhead.py --backend nccl --nproc 1   # a GPU

Each process trains two identical DDP copies of one model (48 x [Linear, GELU, LayerNorm]) in
turn, step by step, one with `Guard(mode="sentinel")` attached: the median over steps of each
guarded step's time divided by the unguarded step of the same round, as rank 0 measured it.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def stack_model(width: int, depth: int) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width))
                           for _ in range(depth)])


def squared_mean(out: torch.Tensor) -> torch.Tensor:
    """The loss, computed outside the model: three functions the guard's loss watch checks."""
    return out.float().pow(2).mean()


def timed_step(model, optimizer, x, device, loss_of=squared_mean, autocast=None) -> float:
    """Seconds of one training step (synchronised on a GPU); `autocast`: bf16 autocast, by
    default on a GPU only."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    autocast = device.type == "cuda" if autocast is None else autocast
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = loss_of(model(x))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _rank(rank: int, world: int, port: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(args.backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    from numguard_nb import Guard

    try:
        device = torch.device(f"cuda:{rank}" if args.backend == "nccl" else "cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.manual_seed(0)
        base = stack_model(args.width, args.depth).to(device)
        plain = nn.parallel.DistributedDataParallel(base)
        guarded = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
        fused = {"fused": True} if device.type == "cuda" else {}
        optimizers = [torch.optim.AdamW(m.parameters(), lr=0.0, **fused) for m in (plain, guarded)]
        guard = Guard(guarded, mode="sentinel").attach()
        x = torch.randn(args.batch, args.width, device=device)
        times = [[], []]
        for i in range(args.warmup + args.steps):
            for which, model in enumerate((plain, guarded)):
                elapsed = timed_step(model, optimizers[which], x, device)
                if i >= args.warmup:
                    times[which].append(elapsed)
        guard.detach()
        if rank == 0:
            ratios = [g / p for p, g in zip(*times)]
            results.put((statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3,
                         statistics.median(ratios)))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--width", type=int, default=None, help="default 256 on CPU, 1024 on a GPU")
    parser.add_argument("--depth", type=int, default=48)
    parser.add_argument("--batch", type=int, default=None, help="default 64 on CPU, 256 on a GPU")
    args = parser.parse_args()
    gpu = args.backend == "nccl"
    if gpu and args.nproc > torch.cuda.device_count():
        parser.error(f"--nproc {args.nproc} with nccl needs as many GPUs; "
                     f"{torch.cuda.device_count()} visible")
    args.width = args.width or (1024 if gpu else 256)
    args.batch = args.batch or (256 if gpu else 64)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.spawn(_rank, args=(args.nproc, port, args, results), nprocs=args.nproc, join=True)
    plain_ms, guarded_ms, ratio = results.get()
    where = torch.cuda.get_device_name(0) if gpu else f"CPU, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}, DDP over {args.backend}, {args.nproc} "
          f"process(es), {args.depth} x [Linear {args.width}, GELU, LayerNorm], batch "
          f"{args.batch}, median of {args.steps} interleaved training steps")
    print(f"| DDP {args.backend} x{args.nproc} | none {plain_ms:.1f} ms | sentinel "
          f"{guarded_ms:.1f} ms | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
