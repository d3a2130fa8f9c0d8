"""Step time (forward + backward) with and without detectors, interleaved in one process.

    python benchmarks/overhead.py [--steps 30] [--device cpu|cuda] [--train]
                                  [--models t5,gpt2,mlp,deep,t5-compiled]
    python benchmarks/overhead.py --device cuda --train --models gpt2-124m,llama-125m,stack194
    python benchmarks/overhead.py --quick     # T5 and the MLP, 8 steps: a first look
    python benchmarks/overhead.py ... --pairs # each detector in rounds of its own (see below)

On this project's 2-core CPU --quick takes about 30 seconds, three models at 12 steps about a
minute; the default run takes several minutes more, most of it inductor compiling T5.

With --train each timed step is a whole training step: forward, backward, an AdamW step and
zero_grad (what a training loop pays; code that runs between the backward and the next forward
shows up only there); on a GPU the AdamW is fused and the forward runs under bf16 autocast, and
a last column counts the blocking host synchronisations of one more step
(`torch.cuda.set_sync_debug_mode("warn")`). "gpt2-124m", "llama-125m" and "stack194" are the
GPU models: GPT-2 124M and a Llama-style 125M on 8 x 1024 tokens, and 48 x [Linear 1024, GELU,
LayerNorm] on a 256 x 1024 batch.

Compares: no detector; numguard Guard (backward on, and forward only); Guard(ops=True)
(op localisation armed: it must cost nothing until a detection); Guard(mode="sentinel") (the
outputs and the gradients checked each step); Hugging Face's DebugUnderflowOverflow (forward
only); torch.autograd.detect_anomaly. "deep" is a stack of many small modules (24 x [Linear 512,
GELU, LayerNorm] on a 64 x 512 batch), where per-module hooks cost the most; "t5-compiled" is T5
under torch.compile (inductor), with no detector, the sentinel on the compiled model (entered
around each step: its hooks sit on the wrapper, so nothing recompiles) and full mode (which sees
only the wrapper's call). Each other detector is attached
once to its own identical copy of the model, as in a training loop. Configurations run round-robin, step by step, so
machine noise hits them alike; the table shows the median step time and the median over rounds of
each step's time divided by the no-detector step of the same round (paired, so that slow drift on
a shared machine cancels out), and the mean of those ratios: the median hides what a few steps
pay (history_every=N runs one batch in N with the full hooks), the mean shows it, noise and all.

With --pairs each detector runs in rounds of its own, with the unguarded model and an unguarded
copy of it, in alternating order: a training loop runs one detector, not eight, and where the host
sets the pace (a GPU step of many small modules) the others' code in between costs time too (on
an H200, GPT-2 124M in full mode: 1.76x round-robin, 1.50x in pairs). The copy's ratio, a last
column, is the noise floor of those rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time

import torch
from torch import nn

from numguard_nb import Guard


def build_t5(device):
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=1024, d_model=256, d_kv=32, d_ff=1024, num_layers=4,
                      num_decoder_layers=4, num_heads=8, decoder_start_token_id=0, pad_token_id=0)
    model = T5ForConditionalGeneration(config).to(device)
    batch = {"input_ids": torch.randint(1, 1024, (8, 128), device=device),
             "labels": torch.randint(1, 1024, (8, 32), device=device)}
    return model, batch


def build_gpt2(device):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=1024, n_positions=256, n_embd=256, n_layer=4, n_head=8)
    model = GPT2LMHeadModel(config).to(device)
    ids = torch.randint(0, 1024, (8, 128), device=device)
    return model, {"input_ids": ids, "labels": ids}


class DeepMLP(nn.Module):
    def __init__(self, width=512, depth=16):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU())
                                      for _ in range(depth)])
        self.head = nn.Linear(width, 1)

    def forward(self, x, labels):
        return nn.functional.mse_loss(self.head(self.layers(x)).squeeze(-1), labels)


def build_mlp(device):
    model = DeepMLP().to(device)
    return model, {"x": torch.randn(256, 512, device=device), "labels": torch.randn(256, device=device)}


class DeepStack(nn.Module):
    """Many small modules: 24 x [Linear 512, GELU, LayerNorm]."""

    def __init__(self, width=512, depth=24):
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU(),
                                                    nn.LayerNorm(width)) for _ in range(depth)])

    def forward(self, x, labels):
        return nn.functional.mse_loss(self.blocks(x), labels)


def build_deep(device):
    model = DeepStack().to(device)
    return model, {"x": torch.randn(64, 512, device=device),
                   "labels": torch.randn(64, 512, device=device)}


def build_gpt2_124m(device):
    """GPT-2 124M as released (12 layers, 768 wide), batch 8 x 1024: random weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).to(device)
    ids = torch.randint(0, config.vocab_size, (8, 1024), device=device)
    return model, {"input_ids": ids, "labels": ids}


def build_llama_125m(device):
    """A Llama-style 125M: 12 layers, 768 wide, grouped-query attention (12 heads, 4 KV heads),
    batch 8 x 1024: random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                         num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                         max_position_embeddings=1024)
    model = LlamaForCausalLM(config).to(device)
    ids = torch.randint(0, config.vocab_size, (8, 1024), device=device)
    return model, {"input_ids": ids, "labels": ids}


class Stack(nn.Module):
    """48 x [Linear 1024, GELU, LayerNorm]: 194 modules, where per-module hooks cost the most."""

    def __init__(self, width=1024, depth=48):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU(),
                                                  nn.LayerNorm(width)) for _ in range(depth))

    def forward(self, x, labels):
        for block in self.blocks:
            x = block(x)
        return torch.nn.functional.mse_loss(x.float(), labels)


def build_stack194(device):
    model = Stack().to(device)
    return model, {"x": torch.randn(256, 1024, device=device),
                   "labels": torch.randn(256, 1024, device=device)}


BUILDERS = {"t5": build_t5, "gpt2": build_gpt2, "mlp": build_mlp, "deep": build_deep,
            "t5-compiled": build_t5, "gpt2-124m": build_gpt2_124m, "llama-125m": build_llama_125m,
            "stack194": build_stack194}


def loss_of(model, batch):
    out = model(**batch)
    return out if isinstance(out, torch.Tensor) else out.loss


def make_configs(model):
    """name -> (model, context factory). Detectors are attached once, each to its own identical
    copy of the model, as in a training loop (Hugging Face's cannot be detached at all)."""
    from transformers.debug_utils import DebugUnderflowOverflow

    def guarded(**options):
        copy_ = copy.deepcopy(model)
        Guard(copy_, **options).attach()
        return copy_, contextlib.nullcontext

    hf_model = copy.deepcopy(model)
    DebugUnderflowOverflow(hf_model)
    return {
        "none": (model, contextlib.nullcontext),
        "numguard fwd+bwd": guarded(),
        "numguard fwd only": guarded(backward=False),
        "numguard ops=True": guarded(ops=True),
        "numguard sentinel": guarded(mode="sentinel"),
        # every 10th batch with the full hooks, into guard.history
        "numguard sentinel, history_every=10": guarded(mode="sentinel", history_every=10),
        "HF DebugUnderflowOverflow (fwd)": (hf_model, contextlib.nullcontext),
        "autograd.detect_anomaly": (model, torch.autograd.detect_anomaly),
    }


def make_compiled_configs(model):
    """One compiled model (inductor) for every configuration: the guards are entered around each
    step, on the compiled model, as a user guards the model they train."""
    compiled = torch.compile(model)
    return {
        "none": (compiled, contextlib.nullcontext),
        "numguard sentinel": (compiled, lambda: Guard(compiled, mode="sentinel")),
        "numguard fwd+bwd (the wrapper only)": (compiled, lambda: Guard(compiled)),
    }


def step(model, batch, context, device, optimizer=None, sync_debug=None):
    """One timed step: forward and backward, and with an optimizer its step and zero_grad (a
    training loop's whole step; on a GPU under bf16 autocast). `sync_debug`: the mode of torch's
    sync detector during the step itself (not the synchronisations that time it)."""
    if optimizer is None:
        model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                and optimizer is not None else contextlib.nullcontext())
    start = time.perf_counter()
    if sync_debug is not None:
        torch.cuda.set_sync_debug_mode(sync_debug)
    try:
        with context():
            with autocast:
                loss = loss_of(model, batch)
            loss.backward()
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    finally:
        if sync_debug is not None:
            torch.cuda.set_sync_debug_mode("default")
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def bench(name, device, steps, warmup=3, train=False, pairs=False, block=1):
    """Rows (detector, median ms, median ratio, mean ratio, host syncs, unguarded copy's ratio).
    Round-robin over every configuration; with `pairs`, each detector in rounds of its own with
    the unguarded model and an unguarded copy of it (the copy's ratio: the noise floor), its
    steps alone between the unguarded ones, as in a training loop that runs one of them: `block`
    steps of each in a row, the first of a block (after another model's steps) not counted."""
    torch.manual_seed(0)
    model, batch = BUILDERS[name](device)
    model.eval()  # no dropout: every configuration computes exactly the same thing
    configs = make_compiled_configs(model) if name.endswith("-compiled") else make_configs(model)
    if pairs:
        configs["none (an unguarded copy)"] = (copy.deepcopy(model), contextlib.nullcontext)
    # lr=0: the weights stay as they are, and every step computes the same thing
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizers = {key: torch.optim.AdamW(m.parameters(), lr=0.0, **fused) if train else None
                  for key, (m, _) in configs.items()}
    detectors = [key for key in configs if not key.startswith("none")]
    groups = ([["none", "none (an unguarded copy)", key] for key in detectors] if pairs
              else [list(configs)])
    times = {key: [] for key in configs}
    copy_times: dict = {}  # detector -> the copy's steps in its rounds
    with warnings_silenced():
        for group in groups:
            base, copy_ = (times["none"], []) if pairs else (None, None)
            if pairs:
                times["none"] = []
            for i in range(warmup + steps):
                for key in (group if i % 2 or not pairs else group[::-1]):
                    m, context = configs[key]
                    for position in range(block if pairs else 1):
                        elapsed = step(m, batch, context, device, optimizers[key])
                        if i >= warmup and (position or block == 1):
                            (copy_ if pairs and key == group[1] else times[key]).append(elapsed)
            if pairs:
                copy_times[group[2]] = (list(times["none"]), copy_)
                times[group[2] + " base"] = times["none"]
                times["none"] = base + times["none"]
        syncs = {key: host_syncs(m, batch, context, device, optimizers[key])
                 for key, (m, context) in configs.items()} if device.type == "cuda" else {}
    rows = []
    for key in ["none"] + detectors:
        values = times[key]
        base = times[key + " base"] if pairs and key != "none" else times["none"][:len(values)]
        ratios = [t / b for t, b in zip(values, base)]
        noise = ""
        if key in copy_times:
            own_base, copies = copy_times[key]
            noise = f"{statistics.median(c / b for c, b in zip(copies, own_base)):.3f}x"
        rows.append((key, statistics.median(values) * 1e3, statistics.median(ratios),
                     statistics.fmean(ratios), syncs.get(key, ""), noise))
    return rows


def host_syncs(model, batch, context, device, optimizer) -> int:
    """Blocking host synchronisations in one more step, as torch's sync detector counts them."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(model, batch, context, device, optimizer, sync_debug="warn")
    return sum("synchroniz" in str(w.message) for w in caught)


@contextlib.contextmanager
def warnings_silenced():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anomaly mode warns on every step
        yield


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 30; 8 with --quick)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default=None,
                        help="default t5,gpt2,mlp,deep,t5-compiled; t5,mlp with --quick")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--train", action="store_true",
                        help="time whole training steps: with an AdamW step and zero_grad")
    parser.add_argument("--pairs", action="store_true",
                        help="time each detector in rounds of its own with the unguarded model and an "
                             "unguarded copy (whose ratio is the noise floor), not all round-robin")
    parser.add_argument("--block", type=int, default=1,
                        help="with --pairs: each configuration's steps in blocks of this many in a row "
                             "(the first of each not counted), as a loop runs one model")
    parser.add_argument("--quick", action="store_true",
                        help="a first look: T5 and the MLP, 8 steps (unless --models/--steps say otherwise)")
    args = parser.parse_args()
    if args.models is None:
        args.models = "t5,mlp" if args.quick else "t5,gpt2,mlp,deep,t5-compiled"
    if args.steps is None:
        args.steps = 8 if args.quick else 30
    started = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    what = "training steps (forward, backward, AdamW step, zero_grad)" if args.train else "steps (forward, backward)"
    how = "in pairs with the unguarded model" if args.pairs else "interleaved"
    if args.pairs and args.block > 1:
        how += f", in blocks of {args.block} steps (the first of each not counted)"
    print(f"torch {torch.__version__}, {label}, median of {args.steps} {what}, {how}\n")
    copy_column = (" unguarded copy |", "---:|") if args.pairs else ("", "")
    print(f"| model | detector | step (ms) | ratio | mean ratio | host syncs per step |{copy_column[0]}\n"
          f"|---|---|---:|---:|---:|---:|{copy_column[1]}")
    for name in args.models.split(","):
        for key, ms, ratio, mean, syncs, noise in bench(name, device, args.steps, train=args.train,
                                                        pairs=args.pairs, block=max(args.block, 1)):
            extra = f" {noise} |" if args.pairs else ""
            print(f"| {name} | {key} | {ms:.1f} | {ratio:.2f}x | {mean:.2f}x | {syncs} |{extra}", flush=True)
    print(f"\n({time.perf_counter() - started:.0f} s in all)")


if __name__ == "__main__":
    main()
