"""KV-cached ``KVCacheRollout.generate`` vs a no-cache recompute, greedy, same weights: tokens/s.

    PYTHONPATH=. python benchmarks/rollout_bench.py            # presets tiny and small
    PYTHONPATH=. python benchmarks/rollout_bench.py --quick    # tiny only, shorter responses

The baseline re-runs the full forward over every sequence for each new token
(``forward_logits`` on the whole prefix, no cache reuse), the cost a rollout without a KV cache
pays. ``same`` checks that both produce the identical greedy tokens (the cache changes speed,
not results); ``speedup`` = uncached seconds / cached seconds. One torch thread, CPU; one
warm-up call of each path before timing.
"""

from __future__ import annotations

import argparse
import time

import torch

from verl_balance.models import LlamaForCausalLM, ModelConfig
from verl_balance.rollout import KVCacheRollout

# (preset, batch, prompt length, new tokens)
FULL_CASES = (("tiny", 16, 32, 64), ("small", 8, 64, 64))
QUICK_CASES = (("tiny", 8, 16, 16),)


def uncached_greedy(rollout: KVCacheRollout, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy decoding by full recompute of every prefix at each step."""
    sequences = [list(p) for p in prompts]
    for _ in range(steps):
        logits = rollout.forward_logits(sequences)
        for seq, seq_logits in zip(sequences, logits):
            seq.append(int(seq_logits[-1].argmax()))
    return [seq[len(p) :] for seq, p in zip(sequences, prompts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small case (smoke run)")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    header = (
        f"{'preset':>6} {'batch':>5} {'prompt':>6} {'new':>4} | {'cached tok/s':>12} {'uncached tok/s':>14} | "
        f"{'speedup':>7} {'same':>5}"
    )
    print(header)
    print("-" * len(header))
    for preset, batch, prompt_len, new in QUICK_CASES if args.quick else FULL_CASES:
        config = ModelConfig.preset(preset)
        model = LlamaForCausalLM(config)
        rollout = KVCacheRollout(model_config=config, state_dict=model.state_dict())
        prompts = torch.randint(0, config.vocab_size, (batch, prompt_len)).tolist()
        # Warm-up (first-call allocations and kernel selection) outside both timings.
        rollout.generate(prompts[:2], temperature=0.0, max_response_length=2)
        uncached_greedy(rollout, prompts[:2], 2)
        start = time.perf_counter()
        out = rollout.generate(prompts, temperature=0.0, max_response_length=new)
        cached = time.perf_counter() - start
        start = time.perf_counter()
        reference = uncached_greedy(rollout, prompts, new)
        uncached = time.perf_counter() - start
        same = out.response_token_lists() == reference
        tokens = batch * new
        print(
            f"{preset:>6} {batch:>5} {prompt_len:>6} {new:>4} | {tokens / cached:>12.0f} {tokens / uncached:>14.0f} | "
            f"{uncached / cached:>7.1f} {str(same):>5}"
        )


if __name__ == "__main__":
    main()
