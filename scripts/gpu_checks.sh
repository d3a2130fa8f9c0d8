#!/usr/bin/env bash
# The checks that need a GPU, in one run of a few minutes (for a lent machine; see README).
#   bash scripts/gpu_checks.sh [OUT_DIR]
# Writes checks.txt (the device, the cuda tests, host syncs, the replay, row cost, DDP), overhead.md,
# attribution.md, memory.txt and profile.txt into OUT_DIR (default $OUT or .): few files, as a
# lent machine sends back at most 8. The overhead table comes first (the figures README carries),
# then the cuda tests; parts that would start past ${GPU_CHECKS_BUDGET_S:-540} s are skipped, so a
# run under a 600 s limit ends by itself with every file whole.
set -u
out=${1:-${OUT:-.}}
mkdir -p "$out"
section() { echo "== $*" | tee -a "$out/checks.txt"; }
budget=${GPU_CHECKS_BUDGET_S:-540}
in_time() { if (( SECONDS + $1 > budget )); then echo "== skipped ($SECONDS s gone): $2" | tee -a "$out/checks.txt"; return 1; fi; }
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi -L | tee -a "$out/checks.txt"
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/checks.txt"

section "overhead of a training step (bf16 autocast, fused AdamW), each detector in pairs with the unguarded model"
timeout 300 python benchmarks/overhead.py --device cuda --train --pairs --block 2 --models gpt2-124m,llama-125m,stack194 --steps 12 2>&1 | tee "$out/overhead.md" | tail -30
section "cuda tests"
timeout 180 python -m pytest -q -p no:cacheprovider -m cuda -ra \
  tests/test_sentinel_deferred.py tests/test_guard.py tests/test_replay.py tests/test_distcheck.py \
  tests/test_stats.py tests/test_reliability_hooks.py tests/test_sentinel_buffers.py \
  2>&1 | tail -25 | tee -a "$out/checks.txt"

in_time 60 "the sentinel with the loss in the model or outside it" && {
  section "the sentinel with the loss in the model or outside it, with and without DDP (one process)"
  timeout 60 python benchmarks/sentinel_where.py 2>&1 | grep -v Warning | tee -a "$out/checks.txt"; }

section "host syncs per training step, a loss outside the model"
timeout 120 python - <<'PY' 2>&1 | tee -a "$out/checks.txt"
import warnings, torch, torch.nn.functional as F
from torch import nn
from numguard_nb import Guard
torch.manual_seed(0)
def count(model, opt, guard_options):
    x = torch.randn(64, 256, device="cuda"); y = torch.randint(0, 10, (64,), device="cuda")
    g = Guard(model, **guard_options).attach() if guard_options is not None else None
    found = []
    for i in range(4):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn" if i == 3 else "default")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x).float(), y)
            loss.backward(); opt.step(); opt.zero_grad()
            torch.cuda.set_sync_debug_mode("default")
        found = [str(w.message).splitlines()[0][:90] + " @ " + w.filename.split("/")[-1] + ":" + str(w.lineno) for w in caught if "synchroniz" in str(w.message)]
    if g is not None: g.detach()
    return found
for name, options in [("none", None), ("sentinel", {"mode": "sentinel"}), ("sentinel history_every=10", {"mode": "sentinel", "history_every": 10}), ("full", {}), ("full ops=True", {"ops": True})]:
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.LayerNorm(512), nn.Linear(512, 10)).cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    found = count(model, opt, options)
    print(f"{name}: {len(found)} host syncs in a step"); [print("   ", f) for f in found]
PY

section "replay of a device-side assert in the loss code"
timeout 120 python - <<'PY' 2>&1 | tail -15 | tee -a "$out/checks.txt"
import torch, torch.nn.functional as F
from torch import nn
from numguard_nb import Guard
from numguard_nb.replay.after_error import replay_after_error, is_device_error
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).cuda()
x = torch.randn(4, 8, device="cuda"); labels = torch.tensor([0, 1, 2, 1], device="cuda")
guard = Guard(model, capture=True)
try:
    with guard:
        loss = F.cross_entropy(model(x), labels)
        loss.backward()
        torch.cuda.synchronize()
except Exception as error:
    print("error:", type(error).__name__, str(error).splitlines()[0][:160], "device error:", is_device_error(error))
    outcome = replay_after_error(guard, error, save_dir="/tmp")
    print(repr(outcome)[:1500])
PY

section "where the time goes: variants with a part switched off, in pairs"
{ in_time 90 "attribution, stack194 sentinel" && timeout 90 python benchmarks/attribute.py \
    --device cuda --model stack194 --steps 30 --variants sentinel,sentinel-put-back-each-call,sentinel-no-flags
  in_time 110 "attribution, stack194 full" && timeout 110 python benchmarks/attribute.py \
    --device cuda --model stack194 --steps 14 --variants full,full-rows-one-at-a-time,full-backward-slots-as-they-come,full-lean-floor
  in_time 150 "attribution, GPT-2 full" && timeout 150 python benchmarks/attribute.py \
    --device cuda --model gpt2-124m --steps 14 --variants full,full-rows-one-at-a-time,full-no-statistics,full-lean-floor
  in_time 150 "attribution, Llama full" && timeout 150 python benchmarks/attribute.py \
    --device cuda --model llama-125m --steps 14 --variants full,full-backward-slots-as-they-come,full-lean-floor
} 2>&1 | tee "$out/attribution.md"

in_time 60 "row cost" && { section "host time per row of full mode's statistics: 0-d rows stacked, rows written in place"
  timeout 60 python benchmarks/row_cost.py --device cuda 2>&1 | tee -a "$out/checks.txt"; }
in_time 90 "DDP over nccl" && { section "DDP over nccl, one process"; timeout 90 python benchmarks/ddp_overhead.py --backend nccl --nproc 1 --steps 20 2>&1 | tail -3 | tee -a "$out/checks.txt"; }
in_time 60 "distcheck over nccl" && { section "distcheck: nccl, one process per GPU"; timeout 60 python -m torch.distributed.run --nproc_per_node 1 -m numguard_nb.distcheck --backend nccl 2>&1 | grep -v "^\s*$" | head -8 | tee -a "$out/checks.txt"; }

in_time 150 "peak memory" && bash scripts/gpu_memory.sh "$out"

echo "== where a step's time goes on the GPU (cProfile, torch.profiler, the device's idle gaps)"
for spec in "stack194 sentinel" "gpt2-124m full"; do
  set -- $spec
  in_time 100 "profile $1 $2" || continue
  echo "=== $1 $2" >> "$out/profile.txt"
  timeout 100 python benchmarks/profile_step.py --model "$1" --config "$2" --device cuda --steps 6 --top 15 \
    2>&1 | grep -v "^USDT\|^STAGE" >> "$out/profile.txt"
done
[ -f "$out/profile.txt" ] && grep -A2 "^===\|device timeline" "$out/profile.txt"
echo "== done in $SECONDS s" | tee -a "$out/checks.txt"
