"""The chunked output head equals the unchunked reference (values and gradients wrt hidden and the
output weight), holds no [T, V] tensor for the backward, and a head with a wrong backward is caught."""

import pytest
import torch

from verl_balance.models import output_head
from verl_balance.models.output_head import LogitTransform, chunked_token_log_probs, head_token_log_probs

V, H = 50, 16
TRANSFORMS = {"identity": LogitTransform(), "scale_softcap": LogitTransform(scale=0.25, softcap=3.0)}


def _problem(n: int, *, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(V, H, generator=g, dtype=dtype).requires_grad_()
    targets = torch.randint(0, V, (n,), generator=g)
    # Upstream gradients of a generic loss: per-token weights on log-probs and on entropy.
    upstream = torch.randn(2, n, generator=g, dtype=dtype)
    per_token_temperature = torch.rand(n, generator=g, dtype=dtype) + 0.5
    return hidden, weight, targets, upstream, per_token_temperature


def _outputs_and_grads(hidden, weight, targets, upstream, *, chunk_size, **head_kwargs):
    log_probs, entropy = head_token_log_probs(hidden, weight, targets, chunk_size=chunk_size, **head_kwargs)
    objective = (upstream[0] * log_probs).sum()
    if entropy is not None:
        objective = objective + (upstream[1] * entropy).sum()
    grad_hidden, grad_weight = torch.autograd.grad(objective, (hidden, weight))
    return {"log_probs": log_probs, "entropy": entropy, "grad_hidden": grad_hidden, "grad_weight": grad_weight}


def _max_relative_error(actual: dict, expected: dict) -> float:
    """Largest |actual - expected| / max|expected| over every output (0 for empty outputs)."""
    worst = 0.0
    for name, ref in expected.items():
        if ref is None:
            assert actual[name] is None, name
            continue
        ref, got = ref.detach(), actual[name].detach()
        assert got.shape == ref.shape and got.dtype == ref.dtype, name
        if ref.numel():
            worst = max(worst, float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)))
    return worst


# fp32: float rounding of a different summation order; float64: the math itself.
TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-12}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("transform", list(TRANSFORMS), ids=str)
@pytest.mark.parametrize("temperature", ["one", "0.7", "per_token"])
@pytest.mark.parametrize("with_entropy", [False, True], ids=["logp", "logp_entropy"])
@pytest.mark.parametrize("n,chunk_size", [(37, 5), (37, 64), (37, 1), (32, 8), (0, 4)])
def test_chunked_head_equals_unchunked_values_and_gradients(dtype, transform, temperature, with_entropy, n, chunk_size):
    hidden, weight, targets, upstream, per_token = _problem(n, dtype=dtype)
    temp = {"one": 1.0, "0.7": 0.7, "per_token": per_token}[temperature]
    kwargs = dict(transform=TRANSFORMS[transform], temperature=temp, with_entropy=with_entropy)
    reference = _outputs_and_grads(hidden, weight, targets, upstream, chunk_size=0, **kwargs)
    chunked = _outputs_and_grads(hidden, weight, targets, upstream, chunk_size=chunk_size, **kwargs)
    assert _max_relative_error(chunked, reference) <= TOLERANCE[dtype]
    if n:  # the comparison is not vacuous: the outputs depend on every knob
        assert reference["grad_weight"].abs().max() > 0


@pytest.mark.parametrize("chunk_size", [5, 64])
def test_chunked_head_matches_unchunked_in_bfloat16(chunk_size):
    """16-bit parameters (FSDP2 mixed precision): fp32 outputs, gradients in the parameter dtype,
    equal up to bf16 rounding (the weight gradient is accumulated over chunks in fp32)."""
    hidden, weight, targets, upstream, _ = _problem(37, dtype=torch.float32)
    hidden = hidden.detach().bfloat16().requires_grad_()
    weight = weight.detach().bfloat16().requires_grad_()
    kwargs = dict(transform=TRANSFORMS["scale_softcap"], temperature=0.7, with_entropy=True)
    reference = _outputs_and_grads(hidden, weight, targets, upstream, chunk_size=0, **kwargs)
    chunked = _outputs_and_grads(hidden, weight, targets, upstream, chunk_size=chunk_size, **kwargs)
    assert chunked["log_probs"].dtype == torch.float32 and chunked["grad_weight"].dtype == torch.bfloat16
    assert _max_relative_error(chunked, reference) <= 2e-2


def _saved_tensor_sizes(fn) -> list[int]:
    sizes = []

    def pack(tensor):
        sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sizes


def test_chunked_head_saves_no_full_vocabulary_tensor_for_backward():
    n = 256
    hidden, weight, targets, _, _ = _problem(n, dtype=torch.float32)

    def head(chunk_size):
        return lambda: head_token_log_probs(
            hidden, weight, targets, transform=TRANSFORMS["scale_softcap"], with_entropy=True, chunk_size=chunk_size
        )

    assert max(_saved_tensor_sizes(head(0))) >= n * V  # the reference keeps [T, V] logits
    assert max(_saved_tensor_sizes(head(16))) <= max(n * H, V * H)


def _break_backward(monkeypatch, how: str) -> None:
    """A chunked head whose backward forgets the temperature or drops the soft-cap."""
    original = output_head._chunk_logit_grad

    def broken(hidden, weight, *, temperature, transform, **kwargs):
        if how == "forgets_temperature":
            temperature = 1.0
        else:
            transform = LogitTransform(scale=transform.scale)
        return original(hidden, weight, temperature=temperature, transform=transform, **kwargs)

    monkeypatch.setattr(output_head, "_chunk_logit_grad", broken)


@pytest.mark.parametrize("how", ["forgets_temperature", "drops_softcap"])
def test_a_chunked_head_with_a_wrong_backward_is_detected(monkeypatch, how):
    hidden, weight, targets, upstream, _ = _problem(37, dtype=torch.float32)
    kwargs = dict(transform=TRANSFORMS["scale_softcap"], temperature=0.7, with_entropy=True)
    reference = _outputs_and_grads(hidden, weight, targets, upstream, chunk_size=0, **kwargs)
    _break_backward(monkeypatch, how)
    broken = _outputs_and_grads(hidden, weight, targets, upstream, chunk_size=5, **kwargs)
    assert _max_relative_error({"log_probs": broken["log_probs"]}, {"log_probs": reference["log_probs"]}) <= 1e-6
    assert _max_relative_error(broken, reference) > 1e-3


def test_bad_chunk_size_and_temperature_are_rejected():
    hidden, weight, targets, _, _ = _problem(4, dtype=torch.float32)
    with pytest.raises(ValueError, match="logits_chunk_size"):
        chunked_token_log_probs(hidden, weight, targets, chunk_size=-1)
    with pytest.raises(ValueError, match="temperature"):
        chunked_token_log_probs(hidden, weight, targets, chunk_size=2, temperature=0.0)
    with pytest.raises(ValueError, match="temperature"):
        chunked_token_log_probs(hidden, weight, targets, chunk_size=2, temperature=torch.tensor([1.0, 1.0, 0.0, 1.0]))


def test_hf_model_head_applies_the_family_logit_transform_in_both_paths(tmp_path):
    """An HF model whose config scales (Granite's logits_scaling) and soft-caps (Gemma's
    final_logit_softcapping) its logits: the chunked head inside HFCausalLM.forward equals
    token_log_probs of the model's own logits, in values and parameter gradients."""
    import json

    from verl_balance.models.hf import HFCausalLM, HFModelConfig
    from verl_balance.models.output_head import token_log_probs
    from verl_balance.models.tiny_hf import write_tiny_model

    path = write_tiny_model(str(tmp_path / "llama"), family="llama")
    config_file = tmp_path / "llama" / "config.json"
    config = json.loads(config_file.read_text())
    config.update(logits_scaling=4.0, final_logit_softcapping=2.0)
    config_file.write_text(json.dumps(config))
    model = HFCausalLM(HFModelConfig.from_pretrained(path))
    assert model.logit_transform == LogitTransform(scale=0.25, softcap=2.0)
    lengths = (6, 3)
    ids = torch.randint(0, model.config.vocab_size, (sum(lengths),), generator=torch.Generator().manual_seed(1))
    inputs = dict(
        input_ids=ids,
        position_ids=torch.cat([torch.arange(n) for n in lengths]),
        cu_seqlens=torch.tensor([0, lengths[0], sum(lengths)]),
        max_seqlen=max(lengths),
    )
    targets = ids.roll(-1)

    def run(chunked: bool):
        model.zero_grad()
        if chunked:
            log_probs, entropy = model(
                **inputs, targets=targets, temperature=0.9, with_entropy=True, logits_chunk_size=4
            )
        else:
            logits = model(**inputs)
            assert logits.abs().max() <= 2.0  # the soft-cap is applied to the model's logits
            log_probs, entropy = token_log_probs(logits, targets, with_entropy=True, temperature=0.9)
        (log_probs.sum() - 0.3 * entropy.sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return {"log_probs": log_probs.detach(), "entropy": entropy.detach(), **grads}

    reference, chunked = run(False), run(True)
    assert reference.keys() == chunked.keys() and len(reference) > 2
    assert _max_relative_error(chunked, reference) <= 1e-6


def _chunked_outputs_and_grads(hidden, weight, targets, upstream, *, chunk_size, keep_last, retain_graph=False, **kw):
    log_probs, entropy = output_head._ChunkedTokenLogProbs.apply(
        hidden, weight, targets, kw["temperature"], kw["transform"], chunk_size, True, keep_last
    )
    objective = (upstream[0] * log_probs).sum() + (upstream[1] * entropy).sum()
    grads = torch.autograd.grad(objective, (hidden, weight), retain_graph=retain_graph)
    again = torch.autograd.grad(objective, (hidden, weight)) if retain_graph else None
    return grads, again


@pytest.mark.parametrize("transform", list(TRANSFORMS), ids=str)
@pytest.mark.parametrize("n,chunk_size", [(37, 5), (37, 64), (40, 8)])
def test_kept_last_chunk_gives_bitwise_the_gradients_of_recomputing_it(transform, n, chunk_size):
    """The backward reuses the forward's last-chunk log-softmax instead of recomputing it: the
    same arithmetic on the same values, so the gradients are bit-identical (not just close)."""
    hidden, weight, targets, upstream, per_token = _problem(n, dtype=torch.float32)
    kw = dict(transform=TRANSFORMS[transform], temperature=per_token)
    (kept_h, kept_w), _ = _chunked_outputs_and_grads(
        hidden, weight, targets, upstream, chunk_size=chunk_size, keep_last=True, **kw
    )
    (re_h, re_w), _ = _chunked_outputs_and_grads(
        hidden, weight, targets, upstream, chunk_size=chunk_size, keep_last=False, **kw
    )
    assert torch.equal(kept_h, re_h) and torch.equal(kept_w, re_w)
    assert re_w.abs().max() > 0


@pytest.mark.parametrize("transform", list(TRANSFORMS), ids=str)
def test_kept_chunk_survives_a_retained_graph_backward(monkeypatch, transform):
    """A second backward over a retained graph reads the kept chunk again: it must be unchanged
    (negative control: a backward consuming it in place is caught by autograd's version check)."""
    hidden, weight, targets, upstream, _ = _problem(37, dtype=torch.float32)
    kw = dict(transform=TRANSFORMS[transform], temperature=0.7)
    first, second = _chunked_outputs_and_grads(
        hidden, weight, targets, upstream, chunk_size=64, keep_last=True, retain_graph=True, **kw
    )
    assert all(torch.equal(a, b) for a, b in zip(first, second))

    original = output_head._logit_grad_from_log_softmax
    monkeypatch.setattr(
        output_head, "_logit_grad_from_log_softmax", lambda *a, inplace, **k: original(*a, inplace=True, **k)
    )
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _chunked_outputs_and_grads(
            hidden, weight, targets, upstream, chunk_size=64, keep_last=True, retain_graph=True, **kw
        )


def test_a_one_chunk_head_projects_once_and_no_grad_keeps_nothing(monkeypatch):
    """Training: the last chunk's logits are not recomputed in backward (a micro-batch that fits
    in one chunk runs the head matmul once, as the unchunked path); no_grad keeps no chunk."""
    hidden, weight, targets, upstream, _ = _problem(37, dtype=torch.float32)
    calls, kept = [], []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **k: calls.append(1) or linear(*a, **k))
    chunk_log_softmax = output_head._chunk_log_softmax
    monkeypatch.setattr(
        output_head,
        "_chunk_log_softmax",
        lambda *a, want_capped: kept.append(want_capped) or chunk_log_softmax(*a, want_capped=want_capped),
    )
    kwargs = dict(transform=TRANSFORMS["scale_softcap"], temperature=0.7, with_entropy=True)
    for chunk_size, projections in [(64, 1), (5, 8 + 7)]:
        calls.clear()
        _outputs_and_grads(hidden, weight, targets, upstream, chunk_size=chunk_size, **kwargs)
        assert len(calls) == projections, chunk_size
    kept.clear()
    with torch.no_grad():
        head_token_log_probs(hidden, weight, targets, chunk_size=5, **kwargs)
    assert kept == [False] * 8
