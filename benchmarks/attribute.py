"""Where a detector's time goes: variants of it with one part switched off, each timed in pairs.

    python benchmarks/attribute.py --device cuda --model stack194 \
        --variants sentinel,sentinel-nested-hooked,sentinel-model-only,sentinel-no-flags
    python benchmarks/attribute.py --device cuda --model gpt2-124m \
        --variants full,full-abs-min,full-no-statistics,full-no-weights,full-forward-only

Each variant runs in a process of its own (a variant patches the package for the whole process):
the unguarded model, an unguarded copy of it (its ratio is the noise floor) and the guarded copy,
in alternating order, `--block` steps of each in a row (the first of a block, after another
model's steps, not counted: a loop runs one model, and the sentinel keeps its nested hooks aside
only while other modules' calls between its model's calls stay few), whole training steps as
`overhead.py --train` times them (on a GPU: bf16 autocast, fused AdamW). A row gives the median extra time a step over the unguarded step of the
same round, and its ratio. A variant is a diagnostic, not a mode: what it leaves out, it does not
check. The variants:

- `sentinel`, `full`: as they are.
- `sentinel-nested-hooked`: the hooks of the entries inside a model stay in place while it runs
  (what `guard/set_aside.py` saves).
- `sentinel-put-back-each-call`: those hooks go back after each call of the model, not kept aside
  between its calls (what `SetAside.end` saves).
- `sentinel-model-only`: only the models hooked, not their callable submodules.
- `sentinel-no-gradient-flag`, `sentinel-no-output-flag`, `sentinel-no-flags`: the step's device
  checks left out (with both, nothing is read back at all).
- `full-abs-min`: every device row also measures abs min (a second reduction a row), as full
  mode did before it measured abs min only where a report shows it: that choice's gain.
- `full-no-statistics`: full mode's hooks and bookkeeping, no statistics computed (no reductions,
  nothing to read back): the hooks' own cost.
- `full-no-weights`: no rows for the weights and buffers.
- `full-rows-one-at-a-time`: every row summarised as it comes (a launch each), as before a
  pass's weights and parameter gradients were summarised together (`RowSink.write_many`): that
  change's gain.
- `full-backward-slots-as-they-come`: each gradient's slots made in its calls as it comes, as
  before a backward's hooks only logged them (`PassRecord.log_gradient`): that change's gain.
- `full-forward-only`: `backward=False`.
- `full-lean-floor`: not the Guard but `lean_floor.LeanFloor`, hooks that keep only a compact
  log of a pass (a row per value, one read a pass, no calls, slots or report): the floor a
  rework of full mode's records could reach.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

VARIANTS = ("sentinel", "sentinel-nested-hooked", "sentinel-put-back-each-call", "sentinel-model-only",
            "sentinel-no-gradient-flag",
            "sentinel-no-output-flag", "sentinel-no-flags", "full", "full-abs-min", "full-no-statistics",
            "full-no-weights", "full-rows-one-at-a-time", "full-backward-slots-as-they-come",
            "full-forward-only", "full-lean-floor")


def parts_switched_off() -> list:
    """(the variants that switch it off, owner, attribute, its stand-in) for every part."""
    from numguard_nb import numerics, stats
    from numguard_nb.guard import guard, hooks, passes, sentinel, set_aside

    def no_weight_row(self, t, role, category, site, nonzero_min, sign_hints):
        return (role, category, passes.VALUE_UNSUPPORTED, t.dtype, tuple(t.shape), None, 0)

    log_gradient = passes.PassRecord.log_gradient

    def slots_as_they_come(self, targets, entry, dtype):
        log_gradient(self, targets, entry, dtype)
        return self.calls  # (reading them makes the slots logged)

    return [
        (("sentinel-nested-hooked",), set_aside.SetAside, "take", lambda self, modules: None),
        (("sentinel-put-back-each-call",), set_aside.SetAside, "end", lambda self: self.put_back()),
        (("sentinel-model-only",), sentinel, "entry_modules",
         lambda prefix, root: iter([(prefix, root, ())])),
        (("sentinel-no-gradient-flag", "sentinel-no-flags"), sentinel, "check_gradients_later",
         lambda owner, calls, parameters: calls),
        (("sentinel-no-output-flag", "sentinel-no-flags"), numerics, "output_flag",
         lambda tensors: None),
        (("full-abs-min",), guard, "_measures_abs_min", lambda owner, batch: True),
        (("full-no-statistics",), stats, "device_stats", lambda t, *args, **kwargs: None),
        (("full-no-weights",), passes.PassRecord, "weight_slot", no_weight_row),
        (("full-rows-one-at-a-time", "full-no-weights"), passes.PassRecord, "summarise_weights",
         lambda self, tensors, nonzero_min: None),
        (("full-rows-one-at-a-time",), hooks.ParamHook, "grad_as_is", lambda self, owner, grad, pass_: None),
        (("full-backward-slots-as-they-come",), passes.PassRecord, "log_gradient", slots_as_they_come),
    ]


def patch(variant: str) -> dict:
    """Switch off what `variant` leaves out (for this process); the Guard's options."""
    for variants, owner, name, stand_in in parts_switched_off():
        if variant in variants:
            if not hasattr(owner, name):  # renamed in the package: the variant would measure nothing
                raise AttributeError(f"{owner.__name__} has no {name}: update benchmarks/attribute.py")
            setattr(owner, name, stand_in)
    if variant.startswith("sentinel"):
        return {"mode": "sentinel"}
    return {"backward": False} if variant == "full-forward-only" else {}


def run_variant(model_name: str, variant: str, device: torch.device, steps: int,
                warmup: int, block: int = 1) -> str:
    from numguard_nb import Guard
    from overhead import BUILDERS, loss_of

    options = patch(variant)
    torch.manual_seed(0)
    model, batch = BUILDERS[model_name](device)
    model.eval()  # no dropout: every configuration computes the same thing
    guarded = copy.deepcopy(model)
    runs = {"none": model, "copy": copy.deepcopy(model), variant: guarded}
    if variant == "full-lean-floor":
        from lean_floor import LeanFloor

        LeanFloor(guarded)
    else:
        Guard(guarded, **options).attach()
    cuda = device.type == "cuda"
    optimizers = {key: torch.optim.AdamW(m.parameters(), lr=0.0, **({"fused": True} if cuda else {}))
                  for key, m in runs.items()}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times: dict = {key: [] for key in runs}
    warnings.simplefilter("ignore")
    for i in range(warmup + steps):
        for key in (list(runs) if i % 2 else list(runs)[::-1]):
            m = runs[key]
            for position in range(block):
                sync()
                start = time.perf_counter()
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                    loss = loss_of(m, batch)
                loss.backward()
                optimizers[key].step()
                optimizers[key].zero_grad(set_to_none=True)
                sync()
                if i >= warmup and (position or block == 1):
                    times[key].append(time.perf_counter() - start)
    base = times["none"]

    def extra(key):
        return (statistics.median(t - b for t, b in zip(times[key], base)) * 1e3,
                statistics.median(t / b for t, b in zip(times[key], base)))

    ms, ratio = extra(variant)
    _, noise = extra("copy")
    return (f"| {model_name} | {variant} | {statistics.median(base) * 1e3:.1f} | {ms:+.2f} | "
            f"{ratio:.3f}x | {noise:.3f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="stack194")
    parser.add_argument("--variants", default="sentinel,sentinel-nested-hooked")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--block", type=int, default=2, help="each run's steps in blocks of this many")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant {unknown[0]!r}: choose from {', '.join(VARIANTS)}")
    device = torch.device(args.device)
    if args.one:
        print(run_variant(args.model, variants[0], device, args.steps, args.warmup, max(args.block, 1)),
              flush=True)
        return
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"torch {torch.__version__}, {label}, {args.model}, median of {args.steps} training steps"
          f" in pairs, in blocks of {args.block}\n\n| model | variant | unguarded step (ms) | extra a step (ms) | ratio |"
          " unguarded copy |\n|---|---|---:|---:|---:|---:|", flush=True)
    for variant in variants:
        child = subprocess.run(
            [sys.executable, __file__, "--one", "--model", args.model, "--variants", variant,
             "--device", args.device, "--steps", str(args.steps), "--warmup", str(args.warmup),
             "--block", str(args.block)],
            capture_output=True, text=True)
        rows = [line for line in child.stdout.splitlines() if line.startswith("|")]
        print(rows[-1] if child.returncode == 0 and rows else
              f"| {args.model} | {variant} | failed: {(child.stderr.strip().splitlines() or ['?'])[-1]} |",
              flush=True)


if __name__ == "__main__":
    main()
