"""Host time the guard adds to a training step where launches, not arithmetic, set the pace,
and the garbage collector's share of it.

    python benchmarks/host_cost.py [--models gpt2-small,stack194-small] [--steps 40] [--gc-steps 300]

On a GPU the statistics of full mode are kernels whose launch costs host time, and a training
step of a model of many small modules waits on the host. This script measures that host time on
CPU: models of realistic depth made small (GPT-2's and a Llama-style model's 12 layers at width
64 and 8 tokens; the 48 x [Linear, GELU, LayerNorm] stack at width 16), bf16 autocast, AdamW, with the GPU's path run on
the host (device rows stacked and read once per pass, the sentinel's flags read later). Each
configuration is attached once to its own copy; configurations take turns, `--block` steps each
(the first of a block, after another model's steps, not counted); the figure is the median of
per-step differences to the unguarded step of the same round, in ms and per module call. The
configuration `lean floor` is not the Guard but `lean_floor.LeanFloor`: hooks that keep only a
compact log of a pass, the floor a leaner full-mode record could reach.

Timing on a shared machine moves by a few tenths of a millisecond from run to run; beside it each
configuration's Python function calls a step are counted (cProfile, 10 steps): a count that does
not move, of the host's work that most of a guard's cost on a GPU is.

A median hides the garbage collector's full collections, which pause the process for 0.1-0.2 s
(transformers loaded) every so many steps. So each configuration then runs `--gc-steps` steps on
its own, counting the collections (`gc.callbacks`): full ones per 1,000 steps and the collector's
time per step, averaged over all steps.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import gc
import pstats
import statistics
import time

import torch
from torch import nn

from numguard_nb import Guard, numerics, stats
from numguard_nb.guard import outside_checks


def build_gpt2_small():
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    config = GPT2Config(n_embd=64, n_head=4, vocab_size=512, n_positions=64, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (1, 8))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


def build_llama_small():
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=12,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (1, 8))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


class SmallStack(nn.Module):
    """48 x [Linear 16, GELU, LayerNorm]: the 194-module stack of overhead.py, made small."""

    def __init__(self, width=16, depth=48):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU(),
                                                  nn.LayerNorm(width)) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.float().square().mean()


def build_stack_small():
    x = torch.randn(4, 16)
    return SmallStack(), lambda m: m(x)


BUILDERS = {"gpt2-small": build_gpt2_small, "llama-small": build_llama_small,
            "stack194-small": build_stack_small}
CONFIGS = {"full": {}, "full fwd only": {"backward": False}, "sentinel": {"mode": "sentinel"},
           "lean floor": None}  # (not a Guard: `lean_floor.LeanFloor`, a leaner record's floor)


def attach(model, options):
    """The configuration's detector on `model` (its `detach()` takes it off)."""
    if options is None:
        from lean_floor import LeanFloor

        return LeanFloor(model)
    return Guard(model, **options).attach()


def step(model, loss_of, optimizer) -> float:
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_of(model)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def bench(name: str, steps: int, gc_steps: int, block: int) -> None:
    torch.manual_seed(0)
    model, loss_of = BUILDERS[name]()
    calls = sum(1 for _ in model.modules())
    runs = {"none": (model, torch.optim.AdamW(model.parameters(), lr=0.0))}
    python = {"none": python_calls(model, loss_of, runs["none"][1])}
    for config, options in CONFIGS.items():
        copy_ = copy.deepcopy(model)
        runs[config] = (copy_, torch.optim.AdamW(copy_.parameters(), lr=0.0))
        guard = attach(copy_, options)  # (counted alone: torch's global hooks are shared)
        python[config] = python_calls(copy_, loss_of, runs[config][1])
        guard.detach()
    guards = [attach(runs[config][0], options) for config, options in CONFIGS.items()]
    times = {config: [] for config in runs}
    counted = max(block - 1, 1)  # (a block's first step, after another model's, is not counted)
    for round_ in range(-(-steps // counted) + 5):
        for config, (m, optimizer) in runs.items():
            for position in range(block):
                elapsed = step(m, loss_of, optimizer)
                if round_ >= 5 and (position or block == 1):  # (5 warm-up rounds)
                    times[config].append(elapsed)
    base = times["none"]
    print(f"{name} ({calls} modules): unguarded step {statistics.median(base) * 1e3:.2f} ms, "
          f"{python['none']:,.0f} Python calls")
    for config in runs:
        extra = statistics.median(t - b for t, b in zip(times[config], base))
        model_, optimizer = runs[config]
        full, seconds = collections_of(model_, loss_of, optimizer, gc_steps) if gc_steps else (0, 0.0)
        print(f"  {config:14s} +{extra * 1e3:6.2f} ms a step, {extra / calls * 1e6:5.1f} us a module,"
              f" {python[config] - python['none']:+7,.0f} Python calls; garbage collector: {full * 1000 / max(gc_steps, 1):4.1f}"
              f" full collections per 1,000 steps, {seconds / max(gc_steps, 1) * 1e3:.2f} ms a step")
    for guard in guards:  # (their global hooks would see the next model's registrations)
        guard.detach()


def python_calls(model, loss_of, optimizer, steps: int = 10) -> float:
    """Python function calls a step (cProfile's count, the builtins called too), after 3 steps."""
    for _ in range(3):
        step(model, loss_of, optimizer)
    profile = cProfile.Profile()
    profile.enable()
    try:
        for _ in range(steps):
            step(model, loss_of, optimizer)
    finally:
        profile.disable()
    return sum(entry[1] for entry in pstats.Stats(profile).stats.values()) / steps


def collections_of(model, loss_of, optimizer, steps: int) -> tuple:
    """(full collections, the collector's seconds) over `steps` steps run alone."""
    events = []

    def note(phase, info):
        events.append((phase, info["generation"], time.perf_counter()))

    gc.callbacks.append(note)
    try:
        for _ in range(steps):
            step(model, loss_of, optimizer)
    finally:
        gc.callbacks.remove(note)
    starts = [(generation, at) for phase, generation, at in events if phase == "start"]
    stops = [at for phase, _, at in events if phase == "stop"]
    full = sum(1 for generation, _ in starts if generation == 2)
    return full, sum(stop - start for (_, start), stop in zip(starts, stops))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(BUILDERS))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--gc-steps", type=int, default=300, help="steps of each alone (0: none)")
    parser.add_argument("--block", type=int, default=4,
                        help="each configuration's steps in blocks of this many in a row, as a loop "
                             "runs one model (the sentinel keeps its nested hooks aside between its "
                             "calls only while other modules' calls between them stay few)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core, as the host of a GPU launches from one thread
    # The GPU's path, on the host: device rows read once per pass, flags and the loss code's
    # regions read later.
    stats.CPU_READS_AT_ONCE = False
    numerics.DEFERRED_DEVICE_TYPES.add("cpu")
    outside_checks.IMMEDIATE_DEVICES = frozenset()
    with contextlib.suppress(KeyboardInterrupt):
        for name in args.models.split(","):
            bench(name, args.steps, args.gc_steps, max(args.block, 1))


if __name__ == "__main__":
    main()
