"""HFCausalLM under Ulysses sp=2 (gloo ranks): logits and summed gradients equal one process."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from _tiny_variants import NEW_FAMILY_VARIANTS

from verl_balance.distributed.launcher import run_on_ranks
from verl_balance.distributed.ulysses import pad_and_slice, padded_length
from verl_balance.models.hf import HFCausalLM, HFModelConfig

LENGTHS = [5, 1, 12, 3, 8]
SP = 2


def _inputs(vocab_size: int, sp: int):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab_size, (sum(LENGTHS),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    total = len(ids)
    padded = padded_length(total, multiple=sp)
    cu = [0] + torch.tensor(LENGTHS).cumsum(0).tolist() + ([padded] if padded > total else [])
    probe = torch.randn(padded, vocab_size, generator=gen)  # fixed random cotangent for the backward
    probe[total:] = 0  # padding is never a target
    return ids, positions, torch.tensor(cu), probe, total


def _run(rank: int | None, *, path: str, sp: int):
    torch.manual_seed(0)
    model = HFCausalLM(HFModelConfig.from_pretrained(path), sp_size=sp)
    model.set_sequence_parallel_group(dist.group.WORLD if sp > 1 else None)
    ids, positions, cu, probe, total = _inputs(model.config.vocab_size, sp)
    r = 0 if rank is None else rank
    local = {k: pad_and_slice(v, rank=r, world=sp) for k, v in (("ids", ids), ("pos", positions), ("probe", probe))}
    logits = model(input_ids=local["ids"], position_ids=local["pos"], cu_seqlens=cu, max_seqlen=max(LENGTHS))
    (logits * local["probe"]).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, total


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["llama", "llama_kv1_tied", "mistral", "qwen3", *NEW_FAMILY_VARIANTS])
def test_ulysses_sp2_logits_and_gradients_equal_single_process(tiny_model_dirs, variant):
    path = tiny_model_dirs[variant]
    ref_logits, ref_grads, total = _run(None, path=path, sp=1)
    results = run_on_ranks(functools.partial(_run, path=path, sp=SP), world=SP)
    logits = torch.cat([r[0] for r in results])[:total]
    torch.testing.assert_close(logits, ref_logits[:total], rtol=1e-5, atol=1e-5)
    for name, grad in ref_grads.items():
        summed = sum(r[1][name] for r in results)  # each SP rank back-propagates its own tokens
        # Reduction order differs between one and two ranks: compare at fp32 noise of the largest entry.
        scale = float(grad.abs().max())
        torch.testing.assert_close(summed, grad, rtol=1e-5, atol=1e-5 * scale, msg=lambda m, name=name: f"{name}: {m}")
