#!/usr/bin/env bash
# Asynchronous GRPO on 2 CPU cores: one-step off-policy (trainer.v1.trainer_mode=separate_async,
# verl's keys) with 1 trainer worker and 1 rollout worker on its own pool, beside the synchronous
# run of the same settings on 1 worker (trainer.v1.trainer_mode=sync). The rollout worker
# generates batch k+1 while the trainer trains batch k (batch k is sampled with the weights of
# step k-1); the weights go actor -> rollout after each step (parameter_sync_step = the step's
# optimizer steps).
# Outputs under $OUT (default outputs/grpo_async_cpu_demo): data/, sync/, async/ (metrics.jsonl,
# curves.png) and curves.png comparing the two runs.
# Extra arguments are Hydra overrides of both runs, e.g. trainer.total_training_steps=80.
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-outputs/grpo_async_cpu_demo}
DIMS="hidden_size=64 intermediate_size=192 num_layers=2"

python -m verl_balance.data.synthetic --out "$OUT/data" --num-train 4096 --num-val 128 --seed 0 \
    --tasks copy --median-size 3 --sigma 0.5 --max-size 6

COMMON=(
    trainer.device=cpu trainer.n_gpus_per_node=1
    actor_rollout_ref.model.name=tiny $(for d in $DIMS; do printf 'actor_rollout_ref.model.%s ' "$d"; done)
    data.train_files="$OUT/data/rl_train.parquet" data.val_files="$OUT/data/rl_val.parquet"
    data.max_prompt_length=32 data.train_batch_size=16
    actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.response_length=16
    actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.actor.optim.lr=1e-3
    trainer.total_training_steps=40 trainer.test_freq=10 trainer.save_freq=-1
)

python -m verl_balance.main_grpo "${COMMON[@]}" trainer.v1.trainer_mode=sync \
    trainer.experiment_name=grpo_sync_demo trainer.default_local_dir="$OUT/sync" "$@"

python -m verl_balance.main_grpo "${COMMON[@]}" trainer.v1.trainer_mode=separate_async \
    trainer.v1.separate_async.parameter_sync_step=1 \
    actor_rollout_ref.rollout.nnodes=1 actor_rollout_ref.rollout.n_gpus_per_node=1 \
    trainer.experiment_name=grpo_async_demo trainer.default_local_dir="$OUT/async" "$@"

python -m verl_balance.utils.plotting "$OUT/sync" "$OUT/async" --labels sync,separate_async \
    --keys '^reward/mean$' --keys '^timing_s/step$' --out "$OUT/curves.png"
