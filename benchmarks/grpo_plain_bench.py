"""One GRPO step as a plain single-process PyTorch loop, per phase, in wall and CPU seconds.

    PYTHONPATH=. python benchmarks/grpo_plain_bench.py [--threads 1,2] [--steps 4] [--response 32]

The floor for ``peer_bench.py grpo-trl``'s shapes (the same random ``small`` Qwen2, 16 synthetic
prompts x 4 responses, up to ``--response`` tokens, fp32, sdpa) with no trainer around it: no Ray,
no dispatch, no planning. Phases of a step:

- ``gen_hf``: ``model.generate`` with TRL's ``GRPOTrainer`` settings (sampling at temperature 1,
  top_p 1, top_k 0, HF's KV cache) on the 64 left-padded rows;
- ``gen_ours``: our ``HFRollout.generate`` (the library's rollout: HF forward, DynamicCache, finished
  rows dropped), the same prompts and lengths;
- ``update``: one forward of the 64 prompt + response rows, log-softmax gather, a token-mean policy
  loss, backward, AdamW step (what one GRPO update on one rank computes, without the old-log-prob
  pass: ours and TRL's both skip it on-policy).

For each ``--threads`` value (``torch.set_num_threads``; interleaved per step, so load drift hits
all) the table gives median wall seconds and CPU seconds (``time.process_time``: all threads of
this process) per phase over the steps after the first. Compare with ``timing_s/*`` of
``main_grpo`` and the TRL phases that ``peer_bench.py`` prints.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

PHASES = ("gen_hf", "gen_ours", "update")


def _prompts(tokenizer, data: str, count: int) -> list[list[int]]:
    import pandas as pd

    rows = pd.read_parquet(data)["prompt"][:count]
    return [
        tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True, return_dict=False)
        for messages in rows
    ]


def _timed(phases: dict, name: str, fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    phases[name] = (time.perf_counter() - wall, time.process_time() - cpu)
    return out


def _left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


def _update(model, optimizer, sequences: list[list[int]], prompt_lens: list[int], pad: int) -> None:
    """Right-padded forward, log p of the response tokens, token-mean policy loss, backward, AdamW."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    loss_mask = torch.zeros((len(sequences), width - 1), dtype=torch.bool)
    for i, (s, p) in enumerate(zip(sequences, prompt_lens)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = True
        loss_mask[i, p - 1 : len(s) - 1] = True
    logits = model(input_ids=ids, attention_mask=mask.long()).logits[:, :-1].float()
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    advantages = torch.randn(len(sequences), 1)
    loss = -(advantages * log_probs)[loss_mask].mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run(args) -> dict[int, dict[str, list[tuple[float, float]]]]:
    from peer_bench import write_data, write_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_balance.models.hf import HFModelConfig
    from verl_balance.rollout.hf_generator import HFRollout

    root = tempfile.mkdtemp(prefix="grpo_plain_")
    model_dir = write_model(os.path.join(root, "model"), args.model)
    data = write_data(os.path.join(root, "data"), num_train=64, sft_median=24.0)["rl"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = _prompts(tokenizer, data, args.prompts)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rollout = HFRollout(model_config=HFModelConfig.from_pretrained(model_dir), pad_token_id=pad)
    rollout.update_weights(model.state_dict())  # the same tensors: the rollout references them
    rows = [p for p in prompts for _ in range(args.n)]
    ids, mask = _left_pad(rows, pad)
    generate_kwargs = dict(
        max_new_tokens=args.response, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=pad
    )
    generate_kwargs["eos_token_id"] = eos
    results: dict[int, dict[str, list[tuple[float, float]]]] = {t: {p: [] for p in PHASES} for t in args.threads}
    for step in range(args.steps):
        for threads in args.threads if step % 2 == 0 else args.threads[::-1]:
            torch.set_num_threads(threads)
            phases: dict[str, tuple[float, float]] = {}
            with torch.no_grad():
                model.eval()
                _timed(phases, "gen_hf", lambda: model.generate(input_ids=ids, attention_mask=mask, **generate_kwargs))
            out = _timed(
                phases,
                "gen_ours",
                lambda: rollout.generate(
                    prompts, n=args.n, max_response_length=args.response, stop_token_ids=(eos,), seed=step
                ),
            )
            responses = [r[: int(n)].tolist() for r, n in zip(out.responses, out.response_lengths)]
            sequences, prompt_lens = [p + r for p, r in zip(rows, responses)], [len(p) for p in rows]
            model.train()
            _timed(phases, "update", lambda: _update(model, optimizer, sequences, prompt_lens, pad))
            cells = ", ".join(f"{k} {w:.3f}/{c:.3f}" for k, (w, c) in phases.items())
            print(f"step {step} threads {threads}: {cells}", flush=True)
            if step > 0:
                for k, v in phases.items():
                    results[threads][k].append(v)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts, interleaved")
    p.add_argument("--steps", type=int, default=4, help="steps per thread count (the first is dropped)")
    p.add_argument("--model", default="small", choices=("tiny", "small"))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--response", type=int, default=32)
    args = p.parse_args()
    args.threads = [int(t) for t in args.threads.split(",")]
    if args.steps < 2:
        p.error("--steps must be at least 2 (the first step is dropped)")
    results = run(args)
    print(f"\nload average {os.getloadavg()}; medians over {args.steps - 1} steps, wall s / CPU s")
    print(f"{'threads':>7} " + " ".join(f"{k:>17}" for k in PHASES))
    for threads, phases in results.items():
        cells = []
        for k in PHASES:
            wall = statistics.median(w for w, _ in phases[k])
            cpu = statistics.median(c for _, c in phases[k])
            cells.append(f"{wall:8.3f}/{cpu:8.3f}")
        print(f"{threads:>7} " + " ".join(cells))


if __name__ == "__main__":
    main()
