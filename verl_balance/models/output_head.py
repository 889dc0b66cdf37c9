"""How a model family turns the output projection into logits: ``hidden @ W_out^T``, then a fixed
``LogitTransform`` (Granite divides by ``logits_scaling``; Gemma 2/3 soft-cap with
``final_logit_softcapping``). Every path producing logits (forward, chunked head, rollout)
applies the same transform, so they agree exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class LogitTransform:
    """``logits = softcap(scale * (hidden @ W_out^T))``; ``softcap`` None means no capping."""

    scale: float = 1.0
    softcap: float | None = None

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"logit scale={self.scale} must be > 0")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"final_logit_softcapping={self.softcap} must be > 0 or None")

    @property
    def is_identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def apply(self, logits: Tensor) -> Tensor:
        """The transform on projected logits (differentiable, dtype kept)."""
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @classmethod
    def from_hf_config(cls, hf_config) -> LogitTransform:
        """Read ``logits_scaling`` and ``final_logit_softcapping``; absent keys mean identity."""
        logits_scaling = getattr(hf_config, "logits_scaling", None)
        softcap = getattr(hf_config, "final_logit_softcapping", None)
        return cls(
            scale=1.0 / float(logits_scaling) if logits_scaling else 1.0,
            softcap=float(softcap) if softcap else None,
        )


Temperature = float | Tensor
"""A sampling temperature: one float, or a per-token [T] tensor (verl's per-sample temperatures)."""


def check_temperature(temperature: Temperature) -> None:
    """Raise ValueError unless every temperature is > 0 (finite)."""
    if isinstance(temperature, Tensor):
        if temperature.numel() and not bool(((temperature > 0) & torch.isfinite(temperature)).all()):
            raise ValueError(f"temperature must be > 0 for every token; got min {float(temperature.min())}")
    elif not (temperature > 0 and temperature != float("inf")):
        raise ValueError(f"temperature={temperature} must be > 0")


def _upcast(logits: Tensor) -> Tensor:
    """fp32 for 16-bit logits (float64 stays float64, so a float64 test checks the math alone)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _divide_by_temperature(logits: Tensor, temperature: Temperature) -> Tensor:
    if isinstance(temperature, Tensor):
        return logits / temperature.to(logits.device, logits.dtype)[:, None]
    return logits / temperature if temperature != 1.0 else logits


def token_log_probs(
    logits: Tensor, targets: Tensor, *, with_entropy: bool = False, temperature: Temperature = 1.0
) -> tuple[Tensor, Tensor | None]:
    """log p(target_t) per position (fp32; float64 stays float64) and optionally the entropy;
    ``temperature`` (float or per-token [T]) divides the logits first."""
    check_temperature(temperature)
    logp = torch.log_softmax(_divide_by_temperature(_upcast(logits), temperature), dim=-1)
    picked = logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else None
    return picked, entropy


def _chunk_logits_from_projection(projected: Tensor, transform: LogitTransform, temperature: Temperature) -> Tensor:
    """fp32 logits / temperature of one chunk, exactly as the unchunked path (transform, fp32, temperature)."""
    return _divide_by_temperature(_upcast(transform.apply(projected)), temperature)


def _slice_temperature(temperature: Temperature, start: int, end: int) -> Temperature:
    return temperature[start:end] if isinstance(temperature, Tensor) else temperature


class _ChunkedTokenLogProbs(torch.autograd.Function):
    """(hidden [T, H], weight [V, H]) -> (log p(target) [T], entropy [T]) in token chunks; at most one
    chunk's [chunk, V] logits are alive."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, transform, chunk_size, with_entropy, keep_last):
        n = hidden.shape[0]
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        log_probs = torch.empty(n, dtype=dtype, device=hidden.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=dtype, device=hidden.device)
        last_logp = last_capped = None
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            chunk_temperature = _slice_temperature(temperature, start, end)
            keep = keep_last and end == n
            logp, capped = _chunk_log_softmax(hidden[start:end], weight, transform, chunk_temperature, want_capped=keep)
            log_probs[start:end] = logp.gather(-1, targets[start:end].long().unsqueeze(-1)).squeeze(-1)
            if with_entropy:
                entropy[start:end] = -logp.exp().mul_(logp).sum(-1)
            if keep:
                last_logp, last_capped = logp, capped
            del logp
        saved_temperature = temperature if isinstance(temperature, Tensor) else None
        ctx.save_for_backward(hidden, weight, targets, entropy, saved_temperature, last_logp, last_capped)
        ctx.temperature = None if saved_temperature is not None else temperature
        ctx.transform, ctx.chunk_size, ctx.with_entropy = transform, chunk_size, with_entropy
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, targets, entropy, temperature, last_logp, last_capped = ctx.saved_tensors
        temperature = temperature if temperature is not None else ctx.temperature
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # The weight's gradient is accumulated over the chunks in fp32 (a transient V x H fp32
        # buffer for 16-bit weights), so chunking adds no rounding step to it.
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros(weight.shape, dtype=grad_log_probs.dtype, device=weight.device)
        n = hidden.shape[0]
        for start in range(0, n, ctx.chunk_size):
            end = min(start + ctx.chunk_size, n)
            upstream = dict(
                targets=targets[start:end],
                temperature=_slice_temperature(temperature, start, end),
                transform=ctx.transform,
                grad_log_probs=grad_log_probs[start:end],
                grad_entropy=grad_entropy[start:end] if ctx.with_entropy else None,
                entropy=entropy[start:end] if ctx.with_entropy else None,
            )
            if last_logp is not None and end == n:
                # the saved chunk is not modified (a retain_graph backward may read it again)
                grad_z = _logit_grad_from_log_softmax(last_logp, last_capped, inplace=False, **upstream)
            else:
                grad_z = _chunk_logit_grad(hidden[start:end], weight, **upstream)
            grad_z = grad_z.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_z @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_z.t().to(grad_weight.dtype), hidden[start:end].to(grad_weight.dtype))
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _chunk_log_softmax(
    hidden: Tensor, weight: Tensor, transform: LogitTransform, temperature: Temperature, *, want_capped: bool
) -> tuple[Tensor, Tensor | None]:
    """log_softmax of one chunk's logits and, with ``want_capped`` under a soft-cap, the fp32 ``tanh``."""
    projected = torch.nn.functional.linear(hidden, weight)
    capped = None
    if want_capped and transform.softcap is not None:
        capped = _upcast(torch.tanh(projected * transform.scale / transform.softcap))
    return torch.log_softmax(_chunk_logits_from_projection(projected, transform, temperature), dim=-1), capped


def _chunk_logit_grad(
    hidden: Tensor,
    weight: Tensor,
    *,
    targets: Tensor,
    temperature: Temperature,
    transform: LogitTransform,
    grad_log_probs: Tensor,
    grad_entropy: Tensor | None,
    entropy: Tensor | None,
) -> Tensor:
    """d(outputs)/d(projected logits z) of one chunk, [chunk, V], from recomputed logits."""
    logp, capped = _chunk_log_softmax(hidden, weight, transform, temperature, want_capped=True)
    return _logit_grad_from_log_softmax(
        logp,
        capped,
        targets=targets,
        temperature=temperature,
        transform=transform,
        grad_log_probs=grad_log_probs,
        grad_entropy=grad_entropy,
        entropy=entropy,
        inplace=True,
    )


def _logit_grad_from_log_softmax(
    logp: Tensor,
    capped: Tensor | None,
    *,
    targets: Tensor,
    temperature: Temperature,
    transform: LogitTransform,
    grad_log_probs: Tensor,
    grad_entropy: Tensor | None,
    entropy: Tensor | None,
    inplace: bool,
) -> Tensor:
    """d(outputs)/d(projected logits z) of one chunk from its log-softmax ``logp``; ``inplace`` consumes
    ``logp`` and ``capped``."""
    p = logp.exp()
    if grad_entropy is not None:
        shifted = logp.add_(entropy[:, None]) if inplace else logp + entropy[:, None]
        grad = shifted.mul_(p).mul_(-grad_entropy[:, None])
        grad.addcmul_(p, grad_log_probs[:, None], value=-1.0)
    else:
        grad = p.mul_(-grad_log_probs[:, None])
    del p, logp
    grad.scatter_add_(-1, targets.long().unsqueeze(-1), grad_log_probs[:, None].to(grad.dtype))
    if isinstance(temperature, Tensor):
        grad.div_(temperature.to(grad.device, grad.dtype)[:, None])
    elif temperature != 1.0:
        grad.div_(temperature)
    if capped is not None:
        grad.mul_((capped.square_() if inplace else capped.square()).neg_().add_(1.0))
    return grad.mul_(transform.scale) if transform.scale != 1.0 else grad


def chunked_token_log_probs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    transform: LogitTransform = LogitTransform(),
    temperature: Temperature = 1.0,
    with_entropy: bool = False,
    chunk_size: int,
) -> tuple[Tensor, Tensor | None]:
    """``token_log_probs(transform(hidden @ weight^T), targets, ...)`` without the [T, V] logits; exact
    forward, analytic gradients."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"logits_chunk_size={chunk_size!r} must be an int >= 1 (or 0 for the unchunked path)")
    check_temperature(temperature)
    # The last chunk's log-softmax is kept for the backward only when one follows (not in no_grad).
    keep_last = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    log_probs, entropy = _ChunkedTokenLogProbs.apply(
        hidden, weight, targets, temperature, transform, chunk_size, with_entropy, keep_last
    )
    return log_probs, entropy if with_entropy else None


@torch.no_grad()
def head_token_stats(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    transform: LogitTransform,
    temperature: Temperature = 1.0,
    chunk_size: int | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(log p(target), entropy, sum_v p(v)^2) per token, fp32, no grad; equal to ``head_token_log_probs``'."""
    check_temperature(temperature)
    n = hidden.shape[0]
    step = chunk_size or max(n, 1)
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    out = torch.empty(3, n, dtype=dtype, device=hidden.device)
    for start in range(0, n, step):
        end = min(start + step, n)
        chunk_temperature = _slice_temperature(temperature, start, end)
        logp, _ = _chunk_log_softmax(hidden[start:end], weight, transform, chunk_temperature, want_capped=False)
        out[0, start:end] = logp.gather(-1, targets[start:end].long().unsqueeze(-1)).squeeze(-1)
        p = logp.exp()
        out[1, start:end] = -(p * logp).sum(-1)
        out[2, start:end] = p.square_().sum(-1)
        del logp, p
    return out[0], out[1], out[2]


def head_token_log_probs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    transform: LogitTransform,
    temperature: Temperature = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None,
) -> tuple[Tensor, Tensor | None]:
    """The output head on final hidden states: chunked when ``chunk_size`` >= 1, else the full reference path."""
    if not chunk_size:
        logits = transform.apply(torch.nn.functional.linear(hidden, weight))
        return token_log_probs(logits, targets, with_entropy=with_entropy, temperature=temperature)
    return chunked_token_log_probs(
        hidden,
        weight,
        targets,
        transform=transform,
        temperature=temperature,
        with_entropy=with_entropy,
        chunk_size=chunk_size,
    )
