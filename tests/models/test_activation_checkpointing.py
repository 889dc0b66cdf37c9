"""Activation checkpointing (model.enable_gradient_checkpointing) on the built-in decoder and an HF
model: it really drops activations (fewer tensors saved for backward in training), and the log-probs
and gradients through the chunked head equal those without it. The FSDP2 cases run in the parity
matrix (MODEL_VARIANTS["activation_ckpt"], tests/parity and tests/models/test_hf_parity.py)."""

import dataclasses

import pytest
import torch

from verl_balance.models import ModelConfig, build_model
from verl_balance.models.hf import HFModelConfig

LENGTHS = (5, 9, 3)


def _inputs(vocab_size: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (sum(LENGTHS),), generator=g)
    return dict(
        input_ids=ids,
        position_ids=torch.cat([torch.arange(n) for n in LENGTHS]),
        cu_seqlens=torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist()),
        max_seqlen=max(LENGTHS),
        targets=ids.roll(-1),
        temperature=0.8,
        with_entropy=True,
        logits_chunk_size=4,
    )


def _run(model_config) -> tuple[int, torch.Tensor, dict]:
    """(tensors saved for backward, log-probs, gradients) of one training forward/backward."""
    torch.manual_seed(0)
    model = build_model(model_config, attn_impl="sdpa_masked")
    model.train()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        log_probs, entropy = model(**_inputs(model_config.vocab_size))
    (log_probs.sum() + 0.1 * entropy.sum()).backward()
    return len(saved), log_probs.detach(), {n: p.grad for n, p in model.named_parameters()}


def _builtin() -> ModelConfig:
    return ModelConfig.preset("tiny")


def _hf(tiny_model_dirs) -> HFModelConfig:
    return HFModelConfig.from_pretrained(tiny_model_dirs["qwen2"])


@pytest.mark.parametrize("kind", ["builtin", "hf_qwen2"])
def test_activation_checkpointing_keeps_log_probs_and_gradients_and_saves_fewer_tensors(kind, request):
    config = _builtin() if kind == "builtin" else _hf(request.getfixturevalue("tiny_model_dirs"))
    saved_plain, log_probs_plain, grads_plain = _run(config)
    saved_ckpt, log_probs_ckpt, grads_ckpt = _run(dataclasses.replace(config, enable_gradient_checkpointing=True))
    assert saved_ckpt < saved_plain  # the decoder layers' activations are recomputed, not kept
    torch.testing.assert_close(log_probs_ckpt, log_probs_plain, rtol=0, atol=0)
    assert grads_plain.keys() == grads_ckpt.keys()
    for name, grad in grads_plain.items():
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=1e-6, atol=1e-7, msg=name)
