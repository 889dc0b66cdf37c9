"""Per-prompt sampling seeds: one batched call vs one call per prompt vs the shared-seed batched call.

    PYTHONPATH=. python benchmarks/rollout_seed_bench.py            # presets tiny and small
    PYTHONPATH=. python benchmarks/rollout_seed_bench.py --quick    # tiny only, shorter responses

Three ways to sample ``n`` responses for a batch of prompts of different lengths (top-p 0.9,
temperature 1, no stop tokens, so every call generates the same number of tokens):

- ``seeds``: ``generate(prompts, seeds=[...])``, one batched call, per-row random streams (ours:
  what ``ActorRolloutWorker.generate_sequences`` does now);
- ``per-prompt``: ``generate([prompt], seeds=[seed])`` for each prompt, what ``generate_sequences``
  did to be layout-invariant before per-row streams;
- ``shared``: ``generate(prompts, seed=0)``, one batched call with one generator for all rows
  (fast but layout-dependent: a prompt's responses change with the rest of the batch).

``same rows`` is the fraction of responses of the batched ``seeds`` call equal token for token to
those of the per-prompt calls. The random numbers are the same by construction; a row can still
differ when the model's logits for it differ in the last bits between a batch and a single prompt
(CPU/GPU matmul kernels depend on the batch shape) and a uniform falls within that rounding of a
CDF boundary: rare with peaked (trained) logits, more frequent with the near-uniform logits of a
freshly initialised model, as here.
Ratios are tokens/s over that of ``shared`` (1.0 = no cost for layout invariance). One torch
thread, CPU; one warm-up call of each path; the best of ``--repeats`` timings.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from verl_balance.models import LlamaForCausalLM, ModelConfig
from verl_balance.rollout import KVCacheRollout

# (preset, prompts, responses per prompt, new tokens)
FULL_CASES = (("tiny", 16, 4, 64), ("tiny", 64, 4, 32), ("small", 16, 4, 32))
QUICK_CASES = (("tiny", 8, 4, 16),)
SAMPLING = dict(temperature=1.0, top_p=0.9)


def batched_seeds(*, rollout, prompts, seeds, **kwargs) -> list[list[int]]:
    """One batched call, a seed per prompt (per-row random streams)."""
    return rollout.generate(prompts, seeds=seeds, **kwargs).response_token_lists()


def per_prompt_calls(*, rollout, prompts, seeds, **kwargs) -> list[list[int]]:
    """One call per prompt with its own seed (the previous layout-invariant rollout)."""
    return [
        response
        for prompt, seed in zip(prompts, seeds)
        for response in rollout.generate([prompt], seeds=[seed], **kwargs).response_token_lists()
    ]


def batched_shared_seed(*, rollout, prompts, seeds, **kwargs) -> list[list[int]]:
    """One batched call, one generator for all rows (layout-dependent)."""
    del seeds
    return rollout.generate(prompts, seed=0, **kwargs).response_token_lists()


def _best_time(fn, repeats: int):
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small case (smoke run)")
    parser.add_argument("--repeats", type=int, default=2, help="timings per path; the best is reported")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    header = (
        f"{'preset':>6} {'prompts':>7} {'n':>2} {'new':>4} | {'seeds tok/s':>11} {'per-prompt tok/s':>16} "
        f"{'shared tok/s':>12} | {'seeds/shared':>12} {'per-prompt/shared':>17} {'seeds/per-prompt':>16} "
        f"{'same rows':>9}"
    )
    print(header)
    print("-" * len(header))
    for preset, num_prompts, n, new in QUICK_CASES if args.quick else FULL_CASES:
        config = ModelConfig.preset(preset)
        rollout = KVCacheRollout(model_config=config, state_dict=LlamaForCausalLM(config).state_dict())
        lengths = torch.randint(8, 33, (num_prompts,)).tolist()
        prompts = [torch.randint(0, config.vocab_size, (length,)).tolist() for length in lengths]
        seeds = list(range(1000, 1000 + num_prompts))
        kwargs = dict(n=n, max_response_length=new, **SAMPLING)

        # Warm-up (first-call allocations and kernel selection) outside the timings.
        rollout.generate(prompts[:2], seeds=seeds[:2], n=1, max_response_length=2, **SAMPLING)
        rollout.generate(prompts[:2], seed=0, n=1, max_response_length=2, **SAMPLING)
        call = dict(rollout=rollout, prompts=prompts, seeds=seeds, **kwargs)
        t_seeds, out_seeds = _best_time(functools.partial(batched_seeds, **call), args.repeats)
        t_prompt, out_prompt = _best_time(functools.partial(per_prompt_calls, **call), args.repeats)
        t_shared, _ = _best_time(functools.partial(batched_shared_seed, **call), args.repeats)
        tokens = num_prompts * n * new
        same_rows = sum(a == b for a, b in zip(out_seeds, out_prompt)) / len(out_seeds)
        print(
            f"{preset:>6} {num_prompts:>7} {n:>2} {new:>4} | {tokens / t_seeds:>11.0f} {tokens / t_prompt:>16.0f} "
            f"{tokens / t_shared:>12.0f} | {t_shared / t_seeds:>12.2f} {t_shared / t_prompt:>17.2f} "
            f"{t_prompt / t_seeds:>16.2f} {same_rows:>9.3f}"
        )


if __name__ == "__main__":
    main()
