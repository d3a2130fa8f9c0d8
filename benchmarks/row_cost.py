"""Host time per tensor of full mode's statistics on a device, and of a pass's one read-back:
rows of 0-d tensors stacked at the read-back against rows written in place into a `RowSink`.

    python benchmarks/row_cost.py [--device cuda] [--rows 1000]

A pass of `--rows` tensors, alternately bfloat16 and float32 (as under bf16 autocast), of
GPT-2 124M's activation size (8 x 1024 x 768 on a GPU; 8 x 64 on CPU, where the reductions' own
arithmetic would hide the host time). Per variant: microseconds of host time per row written,
and milliseconds for the pass's read-back (the device synchronised before each timing).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from numguard_nb import stats


def _synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(tensors: list, device: torch.device, in_place: bool) -> tuple:
    """(host seconds to write the rows, seconds to read them back) of one pass."""
    sink = stats.RowSink() if in_place else None
    _synchronise(device)
    start = time.perf_counter()
    with torch.no_grad():
        rows = [stats.device_stats(t, sink=sink) for t in tensors]
    written = time.perf_counter() - start
    _synchronise(device)  # the reductions done: time the read-back alone
    start = time.perf_counter()
    stats.to_host(rows, sink)
    read = time.perf_counter() - start
    if sink is not None:
        sink.release()
    return written, read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    device = torch.device(args.device)
    stats.CPU_READS_AT_ONCE = False  # on CPU, the GPU's path
    shape = (8, 1024, 768) if device.type == "cuda" else (8, 64)
    distinct = [torch.randn(shape, device=device, dtype=dtype)
                for dtype in (torch.bfloat16, torch.float32) for _ in range(4)]
    tensors = [distinct[i % len(distinct)] for i in range(args.rows)]
    print(f"{args.rows} rows of {tuple(shape)}, bfloat16 and float32, on {device}")
    for name, in_place in (("0-d rows, stacked", False), ("rows written in place", True)):
        run(tensors, device, in_place)  # warm-up (and the sink's blocks)
        runs = [run(tensors, device, in_place) for _ in range(args.repeats)]
        write = statistics.median(w for w, _ in runs) / args.rows * 1e6
        read = statistics.median(r for _, r in runs) * 1e3
        print(f"  {name:22s} {write:6.2f} us a row written, {read:6.2f} ms to read the pass back")


if __name__ == "__main__":
    main()
