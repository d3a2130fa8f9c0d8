export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for spec in "stack194 none" "stack194 sentinel" "gpt2-124m sentinel" "gpt2-124m full" "llama-125m full"; do
  set -- $spec
  echo "=================== $1 $2"
  timeout 150 python benchmarks/profile_step.py --model $1 --config $2 --steps 8 --top 22 2>&1 | grep -v "^USDT\|^STAGE" | tee "$OUT/prof-$1-$2.txt" | head -60
done
