#!/usr/bin/env bash
# GRPO on 2 CPU cores in minutes: a short SFT warm start on the synthetic copy task
# ("copy abc" -> "abc", 1-6 letters), then GRPO from that checkpoint, which raises the held-out
# greedy accuracy. Both stages run on 2 local CPU workers (embedded Ray), balancing on.
# Outputs under $OUT (default outputs/grpo_cpu_demo): data/, sft/, grpo/ with metrics.jsonl and
# curves.png (reward, held-out accuracy, PPO loss, imbalance, response length).
# Extra arguments are Hydra overrides of the GRPO stage, e.g. trainer.total_training_steps=80.
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-outputs/grpo_cpu_demo}
SFT_STEPS=${SFT_STEPS:-400}
DIMS="hidden_size=64 intermediate_size=192 num_layers=2"

python -m verl_balance.data.synthetic --out "$OUT/data" --num-train 4096 --num-val 128 --seed 0 \
    --tasks copy --median-size 3 --sigma 0.5 --max-size 6

# Stage 1: SFT warm start; its last checkpoint is $OUT/sft/global_step_$SFT_STEPS.
python -m verl_balance.main_sft \
    trainer.device=cpu trainer.n_gpus_per_node=2 \
    model.name=tiny $(for d in $DIMS; do printf 'model.%s ' "$d"; done) \
    data.train_files="$OUT/data/sft_train.parquet" data.val_files="$OUT/data/sft_val.parquet" \
    data.train_batch_size=32 data.micro_batch_size_per_gpu=16 \
    optim.lr=5e-3 \
    trainer.total_training_steps="$SFT_STEPS" trainer.save_freq="$SFT_STEPS" trainer.test_freq=100 \
    trainer.experiment_name=grpo_demo_sft trainer.default_local_dir="$OUT/sft"

# Stage 2: GRPO from the SFT weights (model.warm_start_path loads the model weights only).
python -m verl_balance.main_grpo \
    trainer.device=cpu trainer.n_gpus_per_node=2 \
    actor_rollout_ref.model.name=tiny $(for d in $DIMS; do printf 'actor_rollout_ref.model.%s ' "$d"; done) \
    actor_rollout_ref.model.warm_start_path="$OUT/sft/global_step_$SFT_STEPS" \
    data.train_files="$OUT/data/rl_train.parquet" data.val_files="$OUT/data/rl_val.parquet" \
    data.max_prompt_length=32 data.train_batch_size=32 \
    actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.temperature=1.0 \
    actor_rollout_ref.rollout.response_length=10 \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.use_dynamic_bsz=true actor_rollout_ref.actor.ppo_max_token_len_per_gpu=256 \
    actor_rollout_ref.actor.optim.lr=3e-4 \
    actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.001 \
    algorithm.adv_estimator=grpo trainer.balance_batch=true \
    trainer.total_training_steps=40 trainer.test_freq=5 trainer.log_val_generations=4 \
    trainer.experiment_name=grpo_demo trainer.default_local_dir="$OUT/grpo" \
    "$@"
