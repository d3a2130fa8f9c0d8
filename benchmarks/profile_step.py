"""Where a guarded training step's time goes: Python functions (cProfile) and torch ops
(torch.profiler), for one model and one detector configuration.

    python benchmarks/profile_step.py --model stack194 --config sentinel [--device cuda]

Configurations: none, sentinel, full, full-fwd. The step is overhead.py's (bf16 autocast and fused
AdamW on a GPU). Prints the step time, the top Python functions by own time, and the top ops by
CPU time with their counts. On a GPU also the device's timeline: how much of a step it was busy,
its idle gaps (where it waited for Python to launch the next kernel), and the host's time in CUDA
calls that can block (a sync, a copy to pageable memory).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import statistics
import os
import sys
import tempfile

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
    if device.type == "cuda":
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as trace:
                events = json.load(trace).get("traceEvents", [])
        print(device_timeline(events, steps=3))


_DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
_MAY_BLOCK = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy", "cudaMemcpyAsync"}


def device_timeline(events: list, steps: int, gap_us: float = 20.0) -> str:
    """A chrome trace's device activity over `steps` steps: busy time (kernels, copies and sets
    merged where they overlap), idle gaps longer than `gap_us`, and the host's time in calls
    that can block."""
    busy = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                  if e.get("cat") in _DEVICE_CATEGORIES and "dur" in e)
    if not busy:
        return "device timeline: no device activity in the trace"
    total, gaps = 0.0, []
    start, end = busy[0]
    for begin, finish in busy[1:]:
        if begin > end:
            total += end - start
            if begin - end > gap_us:
                gaps.append(begin - end)
            start = begin
        end = max(end, finish)
    total += end - start
    span = max(end - busy[0][0], 1e-9)  # (kernels of no length alone: a span of 0)
    waits: dict = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "cuda_runtime" and e.get("name") in _MAY_BLOCK and "dur" in e:
            waits[e["name"]][0] += 1
            waits[e["name"]][1] += e["dur"]
    longest = ", ".join(f"{gap / 1e3:.2f}" for gap in sorted(gaps, reverse=True)[:5])
    lines = [f"device timeline, per step: busy {total / steps / 1e3:.2f} ms of {span / steps / 1e3:.2f} ms"
             f" ({100 * total / span:.0f}%); {len(gaps) / steps:.0f} idle gaps over {gap_us:.0f} us,"
             f" {sum(gaps) / steps / 1e3:.2f} ms in all; the longest (ms): {longest or '-'}"]
    for name, (count, duration) in sorted(waits.items(), key=lambda item: -item[1][1]):
        lines.append(f"  host in {name}: {count / steps:.1f} calls, {duration / steps / 1e3:.2f} ms a step")
    return "\n".join(lines)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
