"""Where a guarded training step's time goes: Python functions (cProfile) and torch ops
(torch.profiler), for one model and one detector configuration.

    python benchmarks/profile_step.py --model stack194 --config sentinel [--device cuda]

Configurations: none, sentinel, full, full-fwd. The step is overhead.py's (bf16 autocast and fused
AdamW on a GPU). Prints the step time, the top Python functions by own time, and the top ops by
CPU time with their counts.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import os

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import BUILDERS, step  # noqa: E402

from numguard_nb import Guard  # noqa: E402

CONFIGS = {"none": None, "sentinel": {"mode": "sentinel"}, "full": {}, "full-fwd": {"backward": False}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="stack194", choices=sorted(BUILDERS))
    parser.add_argument("--config", default="sentinel", choices=sorted(CONFIGS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    model, batch = BUILDERS[args.model](device)
    model.eval()
    options = CONFIGS[args.config]
    if options is not None:
        Guard(model, **options).attach()
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, **fused)
    def run():
        return step(model, batch, _null, device, optimizer)

    for _ in range(3):
        run()
    times = [run() for _ in range(args.steps)]
    print(f"{args.model} {args.config} on {device}: median step {statistics.median(times) * 1e3:.1f} ms")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps):
        run()
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.top)
    print("\n".join(line for line in out.getvalue().splitlines()[4:] if line.strip()))
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            run()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
