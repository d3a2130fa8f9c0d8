"""Time to record and to render a numerics history of 1,000 sampled batches x 600 module calls.

    python benchmarks/history_render.py [--samples 1000] [--modules 600]

The passes are made up (each module call: output, weight and bias forward; output gradient and
weight and bias gradients backward, six values; the values drift and a few turn nan or inf), fed
through `History.add_pass` as the guard feeds its passes. Printed: the time to record them, the
history's memory, and the time of each view (the numbers behind the views, the HTML with its
SVG heatmap, the text, the DataFrame). The goal: the HTML view of such a history in under a
second.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from numguard_nb._schema import (
    BACKWARD, FORWARD, GRAD_OUTPUT, GRAD_PARAM, OUTPUT, PARAM, VALUE_TENSOR,
)
from numguard_nb.guard.history import History
from numguard_nb.guard.passes import CallRecord, PassRecord

_FORWARD_VALUES = (("output", OUTPUT), ("weight", PARAM), ("bias", PARAM))
_BACKWARD_VALUES = (("grad_output", GRAD_OUTPUT), ("weight.grad", GRAD_PARAM),
                    ("bias.grad", GRAD_PARAM))


def made_up_pass(batch: int, modules: int, phase: str, values, rng) -> PassRecord:
    """A read-back pass of `modules` calls of Linear modules under one root."""
    pass_ = PassRecord()
    root = CallRecord(0, "", "Net", phase, batch, 0, True)
    drift = 10 ** (batch / 400)  # grows tenfold every 400 batches
    for index in range(modules):
        call = CallRecord(index + 1, f"layers.{index}", "Linear", phase, batch, 0, False)
        call.parent = root if phase == FORWARD else None
        call.seq = index
        for role, category in values:
            slot_index = len(pass_.values)
            high = float(rng.uniform(0.5, 2.0) * drift * (1 + index % 7))
            if index == 17 and batch > 900 and role == "output":
                high = float("nan")
            elif index == 33 and batch > 950:
                high = float("inf")
            pass_.values.append([high * 1e-3, high, 0.0])
            call.slots.append((role, category, VALUE_TENSOR, torch.float16, (8, 64), slot_index, 0))
        pass_.calls.append(call)
    root.seq = modules
    pass_.calls.append(root)
    return pass_


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--modules", type=int, default=600)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    history = History(max_samples=max(args.samples, 4))
    passes = [(made_up_pass(b, args.modules, FORWARD, _FORWARD_VALUES, rng),
               made_up_pass(b, args.modules, BACKWARD, _BACKWARD_VALUES, rng))
              for b in range(args.samples)]
    started = time.perf_counter()
    for batch, (forward, backward) in enumerate(passes):
        history.add_pass(forward, batch)
        history.add_pass(backward, batch)
    recorded = time.perf_counter() - started
    held = sum(s.values.nbytes for s in history.samples)
    held += sum({id(s.ids): s.ids.nbytes for s in history.samples}.values())
    print(f"history: {len(history)} samples x {args.modules} module calls "
          f"({len(history.samples[-1].ids)} values a sample), {held / 2**20:.1f} MiB of arrays")
    print(f"record (add_pass, forward + backward): {recorded / len(passes) * 1e3:.2f} ms a batch")
    timings = {}
    for name, make in (("view", history.view), ("html", history._repr_html_),
                       ("text", history.__repr__), ("frame", history.to_frame)):
        started = time.perf_counter()
        result = make()
        timings[name] = time.perf_counter() - started
        size = f", {len(result) / 2**20:.2f} MiB" if isinstance(result, str) else ""
        print(f"{name:>5}: {timings[name]:.3f} s{size}")
    print(f"render the notebook view (numbers + HTML): {timings['html']:.3f} s "
          f"({'under' if timings['html'] < 1 else 'OVER'} a second)")


if __name__ == "__main__":
    main()
