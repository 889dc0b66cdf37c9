#!/usr/bin/env bash
# SFT of a tiny random Hugging Face model (written here, offline) on the synthetic task,
# dp=2 x Ulysses sp=2 on 4 local CPU workers. FAMILY=any family of
# `python -m verl_balance.models.tiny_hf --help` (llama, qwen2, qwen3, mistral, gemma2, gemma3_text, phi3,
# olmo2, granite, qwen2_moe, qwen3_moe, mixtral, deepseek_v2; default qwen2).
# The tokenizer and its chat template come from the model directory (model.tokenizer defaults to
# model.path). Checkpoints at steps 32 and 64 each carry global_step_N/hf, a save_pretrained
# directory (trainer.save_hf_model=true) that AutoModelForCausalLM.from_pretrained loads; any
# checkpoint can also be exported later with
#   python -m verl_balance.export $OUT_DIR/run/global_step_N $OUT_DIR/hf
# Extra arguments are Hydra overrides.
set -euo pipefail
export PYTHONUNBUFFERED=1
out=${OUT_DIR:-outputs/sft_hf_cpu_demo}
python -m verl_balance.models.tiny_hf --family "${FAMILY:-qwen2}" --out "$out/model"
python -m verl_balance.main_sft \
    trainer.device=cpu \
    trainer.n_gpus_per_node=4 \
    ulysses_sequence_parallel_size=2 \
    model.path="$out/model" \
    data.train_batch_size=32 data.micro_batch_size_per_gpu=4 \
    data.synthetic.out_dir="$out/data" \
    balance.enable=true balance.workload=flops \
    optim.lr=3e-3 \
    trainer.total_epochs=1 trainer.test_freq=16 \
    trainer.save_freq=32 trainer.save_hf_model=true \
    trainer.experiment_name=sft_hf_cpu_demo trainer.default_local_dir="$out/run" \
    "$@"
