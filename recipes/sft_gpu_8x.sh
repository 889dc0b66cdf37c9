#!/usr/bin/env bash
# GPU recipe: one node with 8 GPUs, Ulysses sp=2 (dp=4), token-capped dynamic micro-batches,
# bf16 parameters (fp32 master weights and gradient reduce). With MODEL_PATH set to a local
# Hugging Face directory (a family of docs/models.md, e.g. llama, qwen2/3, gemma2, mixtral; its tokenizer and chat template are used)
# it fine-tunes that model with activation checkpointing; without it, the ~100M built-in model.
# Point data.train_files at your own parquet (verl's SFT schema); override anything on the command line.
set -euo pipefail
if [[ -n "${MODEL_PATH:-}" ]]; then
    # the tokenizer and chat template come from MODEL_PATH; every checkpoint also gets global_step_N/hf
    model_args=(model.path="$MODEL_PATH" model.enable_gradient_checkpointing=true trainer.save_hf_model=true)
    lr=1e-5
else
    model_args=(model.name=100m)
    lr=3e-4
fi
python -m verl_balance.main_sft \
    trainer.device=cuda trainer.nnodes=1 trainer.n_gpus_per_node=8 \
    ulysses_sequence_parallel_size=2 \
    "${model_args[@]}" model.param_dtype=bfloat16 \
    data.train_batch_size=256 data.max_length=4096 \
    data.use_dynamic_bsz=true data.max_token_len_per_gpu=16384 \
    data.synthetic.num_train=65536 data.synthetic.num_val=1024 \
    balance.enable=true balance.workload=flops \
    optim.lr=$lr trainer.total_epochs=1 trainer.test_freq=50 trainer.save_freq=200 \
    trainer.logger='[console,jsonl,tensorboard]' trainer.experiment_name=sft_gpu_8x \
    "$@"
