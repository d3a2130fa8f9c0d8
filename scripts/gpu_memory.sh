#!/usr/bin/env bash
# Peak GPU memory of a guarded training step (part of gpu_checks.sh, alone).
set -u
out=${1:-${OUT:-.}}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
echo "== peak GPU memory of a training step, GPT-2 124M (loss in the model, and computed outside it)"
timeout 150 python - <<'PY' 2>&1 | grep -v loss_type | tee "$out/memory.txt"
import copy, sys, torch, torch.nn.functional as F
sys.path.insert(0, "benchmarks")
from overhead import build_gpt2_124m
from numguard_nb import Guard
torch.manual_seed(0)
base, batch = build_gpt2_124m("cuda")
for outside in (False, True):
    for name, options in (("none", None), ("sentinel", {"mode": "sentinel"})):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=0.0, fused=True)
        guard = Guard(model, **options).attach() if options else None
        for i in range(4):
            torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if outside:
                    logits = model(input_ids=batch["input_ids"]).logits
                    loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), batch["labels"].view(-1))
                else:
                    loss = model(**batch).loss
            loss.backward(); opt.step(); opt.zero_grad(); del loss
            if not outside: pass
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**30; held = torch.cuda.memory_allocated() / 2**30
        print(f"loss {'outside' if outside else 'inside'} the model, {name}: peak {peak:.3f} GiB, held between steps {held:.3f} GiB")
        if guard: guard.detach()
        del model, opt, guard
        import gc; gc.collect(); torch.cuda.empty_cache()
PY
