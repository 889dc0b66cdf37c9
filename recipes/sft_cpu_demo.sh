#!/usr/bin/env bash
# The README's main job: SFT of a small built-in model on the generated synthetic task,
# dp=2 x Ulysses sp=2 on 4 local CPU workers (embedded Ray), balancing on (FLOPs workload).
# A few minutes on 2 cores. Extra arguments are Hydra overrides, e.g. trainer.total_epochs=2.
set -euo pipefail
export PYTHONUNBUFFERED=1
python -m verl_balance.main_sft \
    trainer.device=cpu \
    trainer.n_gpus_per_node=4 \
    ulysses_sequence_parallel_size=2 \
    model.name=tiny model.hidden_size=64 model.intermediate_size=192 model.num_layers=2 \
    data.train_batch_size=32 data.micro_batch_size_per_gpu=4 \
    balance.enable=true balance.workload=flops \
    optim.lr=3e-3 \
    trainer.total_epochs=1 trainer.test_freq=16 \
    trainer.experiment_name=sft_cpu_demo \
    "$@"
