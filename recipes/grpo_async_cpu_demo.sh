#!/usr/bin/env bash
# Asynchronous GRPO on 2 CPU cores: one-step off-policy (trainer.v1.trainer_mode=separate_async,
# verl's keys) with 1 trainer worker and 1 rollout worker on its own pool, beside the synchronous
# run of the same settings on 1 worker (trainer.v1.trainer_mode=sync). The rollout worker
# generates batch k+1 while the trainer trains batch k (batch k is sampled with the weights of
# step k-1); the weights go actor -> rollout after each step (parameter_sync_step = the step's
# optimizer steps). Both start from a short SFT warm start on the synthetic copy task (as
# recipes/grpo_cpu_demo.sh): from random weights every sample scores 0 and GRPO has no signal.
# Outputs under $OUT (default outputs/grpo_async_cpu_demo): data/, sft/, sync/, async/
# (metrics.jsonl, curves.png) and curves.png comparing the two runs (its path is printed last).
# Extra arguments are Hydra overrides of both GRPO runs, e.g. trainer.total_training_steps=80.
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-outputs/grpo_async_cpu_demo}
SFT_STEPS=${SFT_STEPS:-400}
DIMS="hidden_size=64 intermediate_size=192 num_layers=2"

python -m verl_balance.data.synthetic --out "$OUT/data" --num-train 4096 --num-val 128 --seed 0 \
    --tasks copy --median-size 3 --sigma 0.5 --max-size 6

# Stage 1: SFT warm start on 2 workers; its last checkpoint is $OUT/sft/global_step_$SFT_STEPS.
python -m verl_balance.main_sft \
    trainer.device=cpu trainer.n_gpus_per_node=2 \
    model.name=tiny $(for d in $DIMS; do printf 'model.%s ' "$d"; done) \
    data.train_files="$OUT/data/sft_train.parquet" data.val_files="$OUT/data/sft_val.parquet" \
    data.train_batch_size=32 data.micro_batch_size_per_gpu=16 optim.lr=5e-3 \
    trainer.total_training_steps="$SFT_STEPS" trainer.save_freq="$SFT_STEPS" trainer.test_freq=100 \
    trainer.experiment_name=grpo_async_demo_sft trainer.default_local_dir="$OUT/sft"

# Stage 2: GRPO from the SFT weights, synchronous then one-step off-policy (same seeds and data).
COMMON=(
    trainer.device=cpu trainer.n_gpus_per_node=1
    actor_rollout_ref.model.name=tiny $(for d in $DIMS; do printf 'actor_rollout_ref.model.%s ' "$d"; done)
    actor_rollout_ref.model.warm_start_path="$OUT/sft/global_step_$SFT_STEPS"
    data.train_files="$OUT/data/rl_train.parquet" data.val_files="$OUT/data/rl_val.parquet"
    data.max_prompt_length=32 data.train_batch_size=32
    actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.rollout.response_length=10
    actor_rollout_ref.actor.ppo_mini_batch_size=16
    actor_rollout_ref.actor.use_dynamic_bsz=true actor_rollout_ref.actor.ppo_max_token_len_per_gpu=256
    actor_rollout_ref.actor.optim.lr=3e-4
    actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.001
    trainer.balance_batch=true
    trainer.total_training_steps=40 trainer.test_freq=5 trainer.save_freq=-1
)

python -m verl_balance.main_grpo "${COMMON[@]}" trainer.v1.trainer_mode=sync \
    trainer.experiment_name=grpo_sync_demo trainer.default_local_dir="$OUT/sync" "$@"

python -m verl_balance.main_grpo "${COMMON[@]}" trainer.v1.trainer_mode=separate_async \
    trainer.v1.separate_async.parameter_sync_step=2 \
    actor_rollout_ref.rollout.nnodes=1 actor_rollout_ref.rollout.n_gpus_per_node=1 \
    trainer.experiment_name=grpo_async_demo trainer.default_local_dir="$OUT/async" "$@"

# Side by side: train reward and held-out accuracy per step, step time, staleness of the samples.
PLOT=$(python - "$OUT" <<'PY'
import os, sys

from verl_balance.utils.plotting import plot_runs

out = sys.argv[1]
panels = (
    ("train score", r"^critic/score/mean$"),
    ("held-out accuracy", r"^val/acc$"),
    ("step time (s)", r"^timing_s/step$"),
    ("staleness (policy versions)", r"^off_policy/staleness_mean$"),
)
print(plot_runs(
    [os.path.join(out, "sync"), os.path.join(out, "async")],
    out=os.path.join(out, "curves.png"),
    labels=["sync", "separate_async"],
    panels=panels,
    title="GRPO on 2 CPU cores: sync vs one-step off-policy (separate rollout worker)",
))
PY
)
echo "sync vs separate_async plot: $PLOT"
