#!/usr/bin/env bash
# GPU recipe: one node with 8 GPUs, Ulysses sp=2 (dp=4), token-capped dynamic micro-batches,
# bf16 parameters, the ~100M built-in model. Point data.train_files at your own parquet
# (verl's SFT schema) and override anything else on the command line.
set -euo pipefail
python -m verl_balance.main_sft \
    trainer.device=cuda trainer.nnodes=1 trainer.n_gpus_per_node=8 \
    ulysses_sequence_parallel_size=2 \
    model.name=100m model.param_dtype=bfloat16 \
    data.train_batch_size=256 data.max_length=4096 \
    data.use_dynamic_bsz=true data.max_token_len_per_gpu=16384 \
    data.synthetic.num_train=65536 data.synthetic.num_val=1024 \
    balance.enable=true balance.workload=flops \
    optim.lr=3e-4 trainer.total_epochs=1 trainer.test_freq=50 trainer.save_freq=200 \
    trainer.logger='[console,jsonl,tensorboard]' trainer.experiment_name=sft_gpu_8x \
    "$@"
