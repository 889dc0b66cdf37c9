#!/usr/bin/env bash
# Parity recipe: the same data, seed and global batches on (dp, sp) = (4,1), (2,2), (1,4),
# token-capped dynamic micro-batches, balancing on. The loss curves must coincide (the
# loss contract); the script overlays them on one figure.
set -euo pipefail
export PYTHONUNBUFFERED=1
out=${OUT_DIR:-outputs/sft_parity}
runs=()
for layout in "4 1" "2 2" "1 4"; do
    set -- $layout
    dp=$1 sp=$2
    name="dp${dp}_sp${sp}"
    python -m verl_balance.main_sft \
        trainer.device=cpu trainer.n_gpus_per_node=4 ulysses_sequence_parallel_size=$sp \
        model.name=tiny data.train_batch_size=32 \
        data.use_dynamic_bsz=true data.max_token_len_per_gpu=512 \
        data.synthetic.out_dir=$out/data \
        trainer.total_training_steps=${STEPS:-20} trainer.resume_mode=disable trainer.plot=false \
        trainer.experiment_name=$name trainer.default_local_dir=$out/$name
    runs+=("$out/$name")
done
python -m verl_balance.utils.plotting "${runs[@]}" --out "$out/parity.png" \
    --title "SFT loss on (4,1), (2,2), (1,4): identical curves"
python - "${runs[@]}" <<'PY'
import sys
from verl_balance.utils.tracking import read_metrics
curves = [[r["train/loss"] for r in read_metrics(run) if "train/loss" in r] for run in sys.argv[1:]]
worst = max(abs(a - b) / abs(b) for c in curves[1:] for a, b in zip(c, curves[0]))
print(f"max relative difference of the loss curves vs (4,1): {worst:.2e}")
PY
