"""Layout-invariance harness: every (dp, sp) layout must reproduce a single-process reference
(docs/design.md, "Parity").

A case passes when both losses and the gradient norm match the plain single-process reference to
rtol 1e-5 and every parameter after the step to 1e-5; the negative controls
(``testing.faults.KNOWN_BUGS``, ``VALUE_NEGATIVE_CONTROLS``) must fail. ``python -m
verl_balance.parity`` prints the table; ``model.path=DIR`` runs it on a local HF model.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from verl_balance.batch_keys import ATTENTION_MASK_KEY, INPUT_IDS_KEY, LOSS_MASK_KEY, RETURNS_KEY, VALUES_KEY
from verl_balance.engine.config import EngineConfig, FSDPConfig, OptimConfig
from verl_balance.loss import AGG_MODES
from verl_balance.models import ModelConfig, build_model, load_model_config

PARITY_LAYOUTS = ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (1, 4))
LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-5
PARAM_ATOL = 1e-5

# FSDPConfig variants of the matrix ("default" is FSDPConfig()).
FSDP_VARIANTS: dict[str, dict] = {
    "default": {},
    "deferred_sync": {"defer_gradient_sync": True},
    "unsharded_step": {"reshard_after_forward": False, "reshard_after_backward": False},
    "deferred_unsharded": {
        "defer_gradient_sync": True,
        "reshard_after_forward": False,
        "reshard_after_backward": False,
    },
}

# Model variants of the matrix: (engine config overrides, model config overrides); "default" is the
# chunked head of ParitySettings.logits_chunk_size without activation checkpointing.
MODEL_VARIANTS: dict[str, tuple[dict, dict]] = {
    "default": ({}, {}),
    "unchunked_head": ({"logits_chunk_size": 0}, {}),
    "activation_ckpt": ({}, {"enable_gradient_checkpointing": True}),
}


@dataclass(frozen=True)
class ParitySettings:
    """The shared problem: model, optimizer, global batch and micro-batching knobs."""

    model: ModelConfig = ModelConfig.preset("tiny")
    num_samples: int = 16
    max_len: int = 40
    micro_batch_size: int = 3
    tokens_per_micro_batch: int = 96  # dynamic cap per SP rank = ceil(this / sp)
    loss_scale_factor: float = 32.0
    lr: float = 1e-2
    # Adam's first step is g / (|g| + eps): with eps = 1e-8 a gradient entry near 1e-8 turns
    # float-rounding noise into a visible parameter difference. A larger eps keeps the step a
    # well-conditioned function of the gradient (and sensitive to its scale) for the comparison.
    adam_eps: float = 1e-5
    grad_clip: float = 1.0
    seed: int = 1234
    # Output-head chunk of the engine: 7 tokens divide no micro-batch of the matrix evenly.
    logits_chunk_size: int = 7
    # Value-model cells: the clip range of the value loss (old values and returns are drawn so that
    # some tokens clip and some do not).
    cliprange_value: float = 0.2
    # A peft adapter directory (write_lora_fixture): the run trains LoRA adapters starting from its
    # values (A and B both non-zero) on ``model`` (an HF model); None = full fine-tuning.
    lora_adapter_path: str | None = None

    def engine_config(
        self, *, agg_mode: str, fsdp: str = "default", variant: str = "default", model_type: str = "language_model"
    ) -> EngineConfig:
        """EngineConfig of one case (constant lr, no warmup: the first step uses lr)."""
        optim = OptimConfig(lr=self.lr, eps=self.adam_eps, clip_grad=self.grad_clip)
        overrides = {"logits_chunk_size": self.logits_chunk_size, **MODEL_VARIANTS[variant][0]}
        if self.lora_adapter_path:
            overrides.update(lora_rank=LORA_RANK, lora_alpha=LORA_ALPHA, lora_adapter_path=self.lora_adapter_path)
        return EngineConfig(
            optim=optim,
            fsdp=FSDPConfig(**FSDP_VARIANTS[fsdp]),
            loss_agg_mode=agg_mode,
            loss_scale_factor=self.loss_scale_factor,
            seed=self.seed,
            attn_impl="sdpa_masked",
            model_type=model_type,
            **overrides,
        )

    def model_config(self, *, variant: str = "default"):
        """The engine's model config of a case (the reference always uses ``model`` as is)."""
        overrides = MODEL_VARIANTS[variant][1]
        return replace(self.model, **overrides) if overrides else self.model


@dataclass(frozen=True)
class ParityCase:
    """One cell of the matrix on one layout (bug set only for negative controls)."""

    micro: str  # "fixed" | "dynamic"
    balance: bool
    agg_mode: str
    bug: str | None = None
    fsdp: str = "default"  # a FSDP_VARIANTS key
    variant: str = "default"  # a MODEL_VARIANTS key
    model_type: str = "language_model"  # "value_model": the value loss on a ValueModel


@dataclass
class ParityResult:
    """Measured vs reference for one (layout, case)."""

    layout: tuple[int, int]
    case: ParityCase
    ref_loss: float
    eval_loss: float
    train_loss: float
    ref_grad_norm: float
    grad_norm: float
    max_param_delta: float

    @staticmethod
    def _rel(value: float, ref: float) -> float:
        return abs(value - ref) / max(abs(ref), 1e-30)

    @property
    def eval_rel(self) -> float:
        return self._rel(self.eval_loss, self.ref_loss)

    @property
    def train_rel(self) -> float:
        return self._rel(self.train_loss, self.ref_loss)

    @property
    def grad_norm_rel(self) -> float:
        return self._rel(self.grad_norm, self.ref_grad_norm)

    @property
    def passed(self) -> bool:
        return (
            self.eval_rel <= LOSS_RTOL
            and self.train_rel <= LOSS_RTOL
            and self.grad_norm_rel <= GRAD_NORM_RTOL
            and self.max_param_delta <= PARAM_ATOL
        )


def matrix_cases() -> list[ParityCase]:
    """{fixed, dynamic} x {balance on, off} x every loss_agg_mode."""
    return [
        ParityCase(micro=m, balance=b, agg_mode=a)
        for m, b, a in itertools.product(("fixed", "dynamic"), (True, False), AGG_MODES)
    ]


FSDP_AGG_MODES = ("token-mean", "seq-mean-token-mean")


def fsdp_cases() -> list[ParityCase]:
    """The non-default FSDP_VARIANTS x {fixed, dynamic} x FSDP_AGG_MODES (multi-rank layouts only)."""
    variants = [v for v in FSDP_VARIANTS if v != "default"]
    return [
        ParityCase(micro=m, balance=True, agg_mode=a, fsdp=v)
        for v, m, a in itertools.product(variants, ("fixed", "dynamic"), FSDP_AGG_MODES)
    ]


def variant_cases(layout: tuple[int, int]) -> list[ParityCase]:
    """The non-default MODEL_VARIANTS on one dynamic token-mean cell each."""
    cases = [ParityCase("dynamic", True, "token-mean", variant=v) for v in MODEL_VARIANTS if v != "default"]
    if layout[0] * layout[1] > 1:
        cases.append(
            ParityCase("fixed", True, "seq-mean-token-mean", fsdp="deferred_unsharded", variant="activation_ckpt")
        )
    return cases


def value_cases() -> list[ParityCase]:
    """The value loss on a value model: {fixed, dynamic} x every loss_agg_mode, balanced."""
    return [
        ParityCase(micro=m, balance=True, agg_mode=a, model_type="value_model")
        for m, a in itertools.product(("fixed", "dynamic"), AGG_MODES)
    ]


# bug -> (layout, case): known-bad normalizers under the value loss (they must FAIL).
VALUE_NEGATIVE_CONTROLS: dict[str, tuple[tuple[int, int], ParityCase]] = {
    "micro_batch_mean": (
        (1, 1),
        ParityCase("fixed", False, "token-mean", "micro_batch_mean", model_type="value_model"),
    ),
    "count_over_world": (
        (1, 2),
        ParityCase("fixed", True, "token-mean", "count_over_world", model_type="value_model"),
    ),
}

# LoRA rows: a tiny HF model (models/tiny_hf.py; the built-in decoder has no LoRA) with rank-4
# adapters on every Linear of the decoder, started from a peft adapter directory with non-zero A and
# B, so both get gradients. The reference injects the same adapters with peft and trains only them.
LORA_RANK = 4
LORA_ALPHA = 8
# (layout, case) negative controls of the LoRA run: a known-bad normalizer must still be detected.
LORA_NEGATIVE_CONTROLS = (
    ((1, 2), ParityCase("fixed", True, "token-mean", "count_over_world")),
    ((1, 1), ParityCase("fixed", False, "token-mean", "micro_batch_mean")),
)


def lora_cases() -> list[ParityCase]:
    """{fixed, dynamic} x every loss_agg_mode, balanced (the LoRA rows of each layout)."""
    return [
        ParityCase(micro=m, balance=True, agg_mode=a) for m, a in itertools.product(("fixed", "dynamic"), AGG_MODES)
    ]


def lora_parity_jobs(
    *, layouts=PARITY_LAYOUTS, controls: bool = True
) -> list[tuple[tuple[int, int], list[ParityCase]]]:
    """The LoRA rows and LoRA negative controls of each layout; run them with ``lora_settings``."""
    return [
        (
            tuple(lay),
            lora_cases() + ([c for where, c in LORA_NEGATIVE_CONTROLS if where == tuple(lay)] if controls else []),
        )
        for lay in layouts
    ]


def write_lora_fixture(out_dir: str) -> tuple[str, str]:
    """A tiny random qwen2 directory and a seeded peft adapter for it: (model_dir, adapter_dir)."""
    import os

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from verl_balance.models.tiny_hf import write_tiny_model

    model_dir = write_tiny_model(os.path.join(out_dir, "qwen2"), family="qwen2", num_kv_heads=1, initializer_range=0.02)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules="all-linear", lora_dropout=0.0)
    peft_model = get_peft_model(base, lora)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in sorted(peft_model.named_parameters()):
            if "lora_" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=gen))
    adapter_dir = os.path.join(out_dir, "adapter")
    peft_model.save_pretrained(adapter_dir)
    return model_dir, adapter_dir


def lora_settings(model_dir: str, adapter_dir: str) -> ParitySettings:
    """ParitySettings of the LoRA rows (write_lora_fixture's directories)."""
    config = load_model_config(name=None, path=model_dir, overrides={}, vocab_size=1)
    return ParitySettings(model=config, lora_adapter_path=adapter_dir)


def _reference_model(settings: ParitySettings):
    """The reference's model: ``settings.model`` as built, with LoRA only the adapters trainable."""
    model = build_model(settings.model, attn_impl="sdpa_masked")
    if settings.lora_adapter_path is None:
        return model
    from peft import LoraConfig, inject_adapter_in_model
    from safetensors.torch import load_file

    lora = LoraConfig.from_pretrained(settings.lora_adapter_path)
    inject_adapter_in_model(lora, model.hf_model)
    prefix = "base_model.model."
    saved = load_file(f"{settings.lora_adapter_path}/adapter_model.safetensors")
    state = {k[len(prefix) :].replace(".weight", ".default.weight"): v for k, v in saved.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lora_" not in k for k in missing), (unexpected, missing)
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_A." in name or ".lora_B." in name)
    return model


# bug -> (layout where it must show, case). Each reproduces a failure mode of docs/design.md.
NEGATIVE_CONTROLS: dict[str, tuple[tuple[int, int], ParityCase]] = {
    "count_over_world": ((1, 2), ParityCase("fixed", True, "token-mean", "count_over_world")),
    "count_local_shard": ((2, 2), ParityCase("fixed", True, "token-mean", "count_local_shard")),
    "eval_local_denominator": ((1, 2), ParityCase("fixed", True, "token-mean", "eval_local_denominator")),
    "roll_after_slice": ((1, 2), ParityCase("fixed", True, "token-mean", "roll_after_slice")),
    "micro_batch_mean": ((1, 1), ParityCase("fixed", False, "token-mean", "micro_batch_mean")),
    "tool_tokens_counted": ((2, 2), ParityCase("dynamic", True, "seq-mean-token-mean", "tool_tokens_counted")),
}


def make_global_batch(settings: ParitySettings) -> dict[str, torch.Tensor]:
    """Seeded right-padded global batch: input_ids, attention_mask, loss_mask (B, max_len).

    Sample 1 has no loss tokens; even multi-turn-shaped samples have a masked span inside the response.
    """
    gen = torch.Generator().manual_seed(settings.seed)
    b, width = settings.num_samples, settings.max_len
    lengths = torch.randint(2, width + 1, (b,), generator=gen)
    lengths[0] = width
    prompt = (torch.rand(b, generator=gen) * (lengths - 1)).long() + 1
    pos = torch.arange(width)[None, :]
    attention_mask = (pos < lengths[:, None]).long()
    loss_mask = ((pos >= prompt[:, None]) & (pos < lengths[:, None])).float()
    loss_mask[1] = 0
    input_ids = torch.randint(0, settings.model.vocab_size, (b, width), generator=gen)
    holes = torch.Generator().manual_seed(settings.seed + 1)
    for i in range(0, b, 2):
        start, end = int(prompt[i]), int(lengths[i])
        if end - start >= 6:
            size = int(torch.randint(1, 4, (1,), generator=holes))
            at = int(torch.randint(start + 1, end - size, (1,), generator=holes))
            loss_mask[i, at : at + size] = 0
    return {INPUT_IDS_KEY: input_ids * attention_mask, ATTENTION_MASK_KEY: attention_mask, LOSS_MASK_KEY: loss_mask}


def reference_steps(settings: ParitySettings, *, agg_modes=AGG_MODES) -> dict[str, dict]:
    """Single-process reference per agg mode: loss, grad norm, parameters after one AdamW step."""
    batch = make_global_batch(settings)
    torch.manual_seed(settings.seed)
    model = _reference_model(settings)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    seq_sums, seq_counts = [], []
    for i in range(settings.num_samples):
        length = int(batch[ATTENTION_MASK_KEY][i].sum())
        ids = batch[INPUT_IDS_KEY][i, :length]
        logits = model(
            input_ids=ids, position_ids=torch.arange(length), cu_seqlens=torch.tensor([0, length]), max_seqlen=length
        )
        logp = torch.log_softmax(logits[:-1].float(), -1).gather(-1, ids[1:, None]).squeeze(-1)
        mask = batch[LOSS_MASK_KEY][i, 1:length]
        seq_sums.append((-logp * mask).sum())
        seq_counts.append(mask.sum())
    sums, counts = torch.stack(seq_sums), torch.stack(seq_counts)
    has_tokens = counts > 0
    objectives = {
        "token-mean": sums.sum() / counts.sum(),
        "seq-mean-token-mean": (sums[has_tokens] / counts[has_tokens]).mean(),
        "seq-mean-token-sum": sums[has_tokens].mean(),
        "seq-mean-token-sum-norm": sums[has_tokens].mean() / settings.loss_scale_factor,
    }
    names = [n for n, _ in model.named_parameters()]
    out = {}
    for mode in agg_modes:
        trainable = [p for p in model.parameters() if p.requires_grad]  # all, or the LoRA adapters
        grads = torch.autograd.grad(objectives[mode], trainable, retain_graph=True)
        step_model = _reference_model(settings)
        step_model.load_state_dict(initial)
        for param, grad in zip([p for p in step_model.parameters() if p.requires_grad], grads):
            param.grad = grad.clone()
        grad_norm = torch.nn.utils.clip_grad_norm_(step_model.parameters(), settings.grad_clip)
        cfg = settings.engine_config(agg_mode=mode).optim
        torch.optim.AdamW(
            step_model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay
        ).step()
        assert names == [n for n, _ in step_model.named_parameters()]
        out[mode] = {
            "loss": objectives[mode].item(),
            "grad_norm": grad_norm.item(),
            "params": {k: v.detach().clone() for k, v in step_model.state_dict().items()},
        }
    return out


def make_value_batch(settings: ParitySettings) -> dict[str, torch.Tensor]:
    """``make_global_batch`` plus seeded ``values`` and ``returns`` (B, max_len), 0 outside the mask."""
    batch = make_global_batch(settings)
    gen = torch.Generator().manual_seed(settings.seed + 1)
    shape = batch[INPUT_IDS_KEY].shape
    real = batch[ATTENTION_MASK_KEY].float()
    batch[VALUES_KEY] = 0.3 * torch.randn(shape, generator=gen) * real
    batch[RETURNS_KEY] = torch.randn(shape, generator=gen) * real
    return batch


def reference_value_model(settings: ParitySettings):
    """The seeded initial value model, built in one process (models/value.py's init rule)."""
    from verl_balance.engine.materialize import value_head_init
    from verl_balance.models.value import build_value_model

    torch.manual_seed(settings.seed)
    model = build_value_model(settings.model, attn_impl="sdpa_masked")
    with torch.no_grad():
        for name in model.head_parameter_names:
            param = model.get_parameter(name)
            param.copy_(value_head_init(name, tuple(param.shape), seed=settings.seed, std=model.initializer_range))
    return model


def _reference_value_sums(model, batch: dict[str, torch.Tensor], *, cliprange_value: float):
    """Per sequence (sum of verl's clipped value loss over loss tokens, loss-token count), plain forward."""
    seq_sums, seq_counts = [], []
    for i, length in enumerate(batch[ATTENTION_MASK_KEY].sum(1).tolist()):
        ids = batch[INPUT_IDS_KEY][i, :length]
        v = model(
            input_ids=ids, position_ids=torch.arange(length), cu_seqlens=torch.tensor([0, length]), max_seqlen=length
        )[:-1]
        old, returns = batch[VALUES_KEY][i, 1:length], batch[RETURNS_KEY][i, 1:length]
        v_clip = torch.minimum(torch.maximum(v, old - cliprange_value), old + cliprange_value)
        loss = 0.5 * torch.maximum((v - returns) ** 2, (v_clip - returns) ** 2)
        mask = batch[LOSS_MASK_KEY][i, 1:length]
        seq_sums.append((loss * mask).sum())
        seq_counts.append(mask.sum())
    return torch.stack(seq_sums), torch.stack(seq_counts)


def _agg_objectives(sums: torch.Tensor, counts: torch.Tensor, *, loss_scale_factor: float) -> dict[str, torch.Tensor]:
    """Every loss_agg_mode's objective from per-sequence loss sums and loss-token counts."""
    has_tokens = counts > 0
    return {
        "token-mean": sums.sum() / counts.sum(),
        "seq-mean-token-mean": (sums[has_tokens] / counts[has_tokens]).mean(),
        "seq-mean-token-sum": sums[has_tokens].mean(),
        "seq-mean-token-sum-norm": sums[has_tokens].mean() / loss_scale_factor,
    }


def reference_value_steps(settings: ParitySettings, *, agg_modes=AGG_MODES) -> dict[str, dict]:
    """Single-process reference of the value cells per agg mode (keys ``value_model/<mode>``)."""
    batch = make_value_batch(settings)
    model = reference_value_model(settings)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sums, counts = _reference_value_sums(model, batch, cliprange_value=settings.cliprange_value)
    objectives = _agg_objectives(sums, counts, loss_scale_factor=settings.loss_scale_factor)
    out = {}
    for mode in agg_modes:
        grads = torch.autograd.grad(objectives[mode], list(model.parameters()), retain_graph=True)
        step_model = reference_value_model(settings)
        step_model.load_state_dict(initial)
        for param, grad in zip(step_model.parameters(), grads):
            param.grad = grad.clone()
        grad_norm = torch.nn.utils.clip_grad_norm_(step_model.parameters(), settings.grad_clip)
        cfg = settings.engine_config(agg_mode=mode).optim
        torch.optim.AdamW(
            step_model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay
        ).step()
        out[f"value_model/{mode}"] = {
            "loss": objectives[mode].item(),
            "grad_norm": grad_norm.item(),
            "params": {k: v.detach().clone() for k, v in step_model.state_dict().items()},
        }
    return out


def reference_key(case: ParityCase) -> str:
    """The key of a case's reference in ``run_layouts``' references."""
    return case.agg_mode if case.model_type == "language_model" else f"{case.model_type}/{case.agg_mode}"


def reference_log_probs(
    settings: ParitySettings, batch: dict[str, torch.Tensor], *, temperature: float = 1.0
) -> torch.Tensor:
    """(B, L) log p(token t | tokens < t) at ``temperature`` of the seeded initial model (0 at t = 0 and
    on padding); no distributed code."""
    torch.manual_seed(settings.seed)
    model = build_model(settings.model, attn_impl="sdpa_masked")
    out = torch.zeros(batch[INPUT_IDS_KEY].shape)
    with torch.no_grad():
        for i, length in enumerate(batch[ATTENTION_MASK_KEY].sum(1).tolist()):
            ids = batch[INPUT_IDS_KEY][i, :length]
            logits = model(
                input_ids=ids,
                position_ids=torch.arange(length),
                cu_seqlens=torch.tensor([0, length]),
                max_seqlen=length,
            )
            logp = torch.log_softmax(logits[:-1].float() / temperature, -1)
            out[i, 1:length] = logp.gather(-1, ids[1:, None]).squeeze(-1)
    return out


def max_param_delta(engine, ref_params: dict[str, torch.Tensor]) -> float:
    """max |parameter - reference| over ``ref_params``, on every rank. Collective: every rank must call
    this (one all-reduce(MAX))."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    state = engine.model.state_dict()
    delta = torch.zeros(())
    for name, ref in ref_params.items():
        value = state[name]
        if isinstance(value, DTensor):
            local_ref = distribute_tensor(ref, value.device_mesh, value.placements, src_data_rank=None).to_local()
            value = value.to_local()
        else:
            local_ref = ref
        if value.numel():
            delta = torch.maximum(delta, (value.detach().cpu() - local_ref).abs().max())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(delta, op=dist.ReduceOp.MAX)
    return float(delta)


def _run_cases(
    *, dp: int, sp: int, cases: list[ParityCase], settings: ParitySettings, references: dict[str, dict]
) -> list:
    """(case, eval loss, train loss, grad norm, max parameter delta to ``references``) per case."""
    from verl_balance.algorithms.value_loss import ValueLoss
    from verl_balance.balance import plan_balance
    from verl_balance.distributed import ParallelLayout
    from verl_balance.engine import TrainEngine
    from verl_balance.testing.faults import FaultyTrainEngine

    layout = ParallelLayout(dp=dp, sp=sp, device_type="cpu")
    batches = {"language_model": make_global_batch(settings), "value_model": make_value_batch(settings)}
    seq_lens = batches["language_model"][ATTENTION_MASK_KEY].sum(1).numpy()
    results = []
    for case in cases:
        batch = batches[case.model_type]
        loss_fn = ValueLoss(cliprange_value=settings.cliprange_value) if case.model_type == "value_model" else None
        fixed = case.micro == "fixed"
        plan = plan_balance(
            seq_lens=seq_lens,
            dp_size=dp,
            sp_size=sp,
            micro_batch_size=settings.micro_batch_size if fixed else None,
            max_token_len_per_gpu=None if fixed else -(-settings.tokens_per_micro_batch // sp),
            balance=case.balance,
        )
        micro_batches = [
            {k: v[torch.as_tensor(np.asarray(idx, dtype=np.int64))] for k, v in batch.items()}
            for idx in plan.micro_batches[layout.dp_rank]
        ]
        kwargs = dict(
            model_config=settings.model_config(variant=case.variant),
            layout=layout,
            engine_config=settings.engine_config(
                agg_mode=case.agg_mode, fsdp=case.fsdp, variant=case.variant, model_type=case.model_type
            ),
        )
        engine = FaultyTrainEngine(bug=case.bug, **kwargs) if case.bug else TrainEngine(**kwargs)
        evaluated = engine.eval_loss(micro_batches, loss_fn=loss_fn)
        trained = engine.train_batch(micro_batches, loss_fn=loss_fn)
        delta = max_param_delta(engine, references[reference_key(case)]["params"])
        results.append((case, evaluated["loss"], trained["loss"], trained["grad_norm"], delta))
    return results


def _parity_worker(rank: int, jobs: list, settings: ParitySettings, references: dict[str, dict]) -> dict:
    """This process's part of every job: {job index: results} for the jobs whose first rank it is."""
    from verl_balance.distributed.launcher import gloo_group

    torch.set_num_threads(1)
    out = {}
    for index, first_rank, dp, sp, init_method, cases in jobs:
        if not first_rank <= rank < first_rank + dp * sp:
            continue
        with gloo_group(rank=rank - first_rank, world_size=dp * sp, init_method=init_method):
            results = _run_cases(dp=dp, sp=sp, cases=cases, settings=settings, references=references)
        if rank == first_rank:
            out[index] = results
    return out


def pack_waves(sizes: list[int], *, world: int) -> list[tuple[int, int]]:
    """(wave, first rank) per job of ``sizes`` ranks: largest first, each into the first wave with room."""
    free: list[int] = []  # next free rank per wave
    placed = {}
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        wave = next((w for w, used in enumerate(free) if used + sizes[index] <= world), len(free))
        if wave == len(free):
            free.append(0)
        placed[index] = (wave, free[wave])
        free[wave] += sizes[index]
    return [placed[i] for i in range(len(sizes))]


def run_layouts(
    *,
    jobs: list[tuple[tuple[int, int], list[ParityCase]]],
    settings: ParitySettings,
    references: dict[str, dict] | None = None,
) -> list[ParityResult]:
    """Run (layout, cases) jobs in ONE set of spawned processes (max dp*sp of them), one gloo group per
    layout."""
    from verl_balance.distributed.launcher import new_rendezvous, run_on_ranks

    references = references if references is not None else {}
    cases = [c for _, layout_cases in jobs for c in layout_cases]
    missing = sorted({c.agg_mode for c in cases if c.model_type == "language_model"} - set(references))
    if missing:
        references.update(reference_steps(settings, agg_modes=missing))
    # Value references are keyed "value_model/<agg_mode>" (reference_key), apart from the LM's.
    missing = sorted({c.agg_mode for c in cases if c.model_type == "value_model"})
    missing = [m for m in missing if f"value_model/{m}" not in references]
    if missing:
        references.update(reference_value_steps(settings, agg_modes=missing))
    world = max(dp * sp for (dp, sp), _ in jobs)
    places = pack_waves([dp * sp for (dp, sp), _ in jobs], world=world)
    spawn_jobs = sorted(
        (wave, index, first, dp, sp, new_rendezvous(), cases)
        for index, (((dp, sp), cases), (wave, first)) in enumerate(zip(jobs, places))
    )
    ref_params = {key: {"params": ref["params"]} for key, ref in references.items()}
    per_rank = run_on_ranks(
        functools.partial(
            _parity_worker, jobs=[job[1:] for job in spawn_jobs], settings=settings, references=ref_params
        ),
        world=world,
        init_group=False,
    )
    by_job = {index: found for rank_results in per_rank for index, found in rank_results.items()}
    results = []
    for index, (layout, _) in enumerate(jobs):
        layout_results = by_job[index]
        for case, eval_loss, train_loss, grad_norm, delta in layout_results:
            ref = references[reference_key(case)]
            results.append(
                ParityResult(
                    layout=layout,
                    case=case,
                    ref_loss=ref["loss"],
                    eval_loss=eval_loss,
                    train_loss=train_loss,
                    ref_grad_norm=ref["grad_norm"],
                    grad_norm=grad_norm,
                    max_param_delta=delta,
                )
            )
    return results


def parity_jobs(
    *,
    layouts=PARITY_LAYOUTS,
    controls: bool = True,
    fsdp: bool = True,
    variants: bool = True,
    values: bool = True,
    language_model: bool = True,
) -> list[tuple[tuple[int, int], list[ParityCase]]]:
    """The parity matrix, FSDP-control, model-variant and value-model cells, and negative controls per
    layout (``language_model=False``: value-model cells and controls only)."""
    jobs = []
    for layout in layouts:
        cases = []
        if language_model:
            cases += matrix_cases()
            cases += fsdp_cases() if fsdp and layout[0] * layout[1] > 1 else []
            cases += variant_cases(tuple(layout)) if variants else []
            cases += [case for lay, case in NEGATIVE_CONTROLS.values() if lay == layout] if controls else []
        if values:
            cases += value_cases()
            cases += [case for lay, case in VALUE_NEGATIVE_CONTROLS.values() if lay == layout] if controls else []
        jobs.append((tuple(layout), cases))
    return jobs


def format_table(results: list[ParityResult], *, expect_fail: bool = False) -> str:
    """Plain-text table, one row per (layout, case)."""
    header = (
        f"{'dp x sp':>7} {'model':>5} {'micro':>7} {'bal':>3} {'loss_agg_mode':>23} {'fsdp':>18} "
        f"{'variant':>15} {'bug':>22} "
        f"{'ref loss':>10} {'eval rel':>9} {'train rel':>9} {'gnorm rel':>9} "
        f"{'max|dp|':>8} {'result':>6}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        ok = r.passed != expect_fail
        verdict = ("FAIL" if not r.passed else "pass") + ("" if ok else "!")
        lines.append(
            f"{r.layout[0]:>3} x {r.layout[1]:<1} {'value' if r.case.model_type == 'value_model' else 'lm':>5} "
            f"{r.case.micro:>7} "
            f"{'on' if r.case.balance else 'off':>3} {r.case.agg_mode:>23} "
            f"{r.case.fsdp:>18} {r.case.variant:>15} {r.case.bug or '-':>22} {r.ref_loss:>10.6f} {r.eval_rel:>9.1e} "
            f"{r.train_rel:>9.1e} {r.grad_norm_rel:>9.1e} {r.max_param_delta:>8.1e} "
            f"{verdict:>6}"
        )
    return "\n".join(lines)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The CLI options; ``model.path=DIR`` (or verl's ``model.partial_pretrain=DIR``) sets ``model_path``."""
    parser = argparse.ArgumentParser(
        prog="python -m verl_balance.parity", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--layouts",
        default=",".join(f"{d}x{s}" for d, s in PARITY_LAYOUTS),
        help="comma-separated DPxSP list (default: the full matrix)",
    )
    parser.add_argument("--no-controls", action="store_true", help="skip negative controls")
    parser.add_argument("--no-fsdp", action="store_true", help="skip the FSDP-control cells")
    parser.add_argument("--no-variants", action="store_true", help="skip the model-variant cells")
    parser.add_argument("--no-values", action="store_true", help="skip the value-model cells")
    parser.add_argument(
        "--model-path",
        default=None,
        help="a local Hugging Face model directory (also accepted as model.path=DIR); "
        "default: the built-in tiny decoder",
    )
    args, rest = parser.parse_known_args(argv)
    for item in rest:
        key, _, value = item.partition("=")
        if key not in ("model.path", "model.partial_pretrain") or not value:
            parser.error(f"unrecognized argument {item!r}; valid: model.path=DIR or the options above")
        args.model_path = value
    return args


def _report(results: list[ParityResult], *, seconds: float) -> bool:
    """Print the tables and a summary line; True when every cell passes and every control fails."""
    value_cells = [r for r in results if r.case.bug is None and r.case.model_type == "value_model"]
    plain = [r for r in results if r.case.bug is None and r.case.variant == "default" and r not in value_cells]
    matrix = [r for r in plain if r.case.fsdp == "default"]
    fsdp_cells = [r for r in plain if r.case.fsdp != "default"]
    variant_cells = [r for r in results if r.case.bug is None and r.case.variant != "default"]
    controls = [r for r in results if r.case.bug is not None]
    print(format_table(matrix))
    ok = all(r.passed for r in matrix + fsdp_cells + variant_cells + value_cells)
    if fsdp_cells:
        print("\nFSDP gradient-accumulation controls (must pass):")
        print(format_table(fsdp_cells))
    if variant_cells:
        print("\nmodel variants: unchunked head, activation checkpointing (must pass):")
        print(format_table(variant_cells))
    if value_cells:
        print("\nvalue model: verl's clipped value loss (must pass):")
        print(format_table(value_cells))
    if controls:
        print("\nnegative controls (must FAIL):")
        print(format_table(controls, expect_fail=True))
        ok = ok and not any(r.passed for r in controls)
    print(
        f"\n{sum(r.passed for r in matrix)}/{len(matrix)} matrix cells pass, "
        f"{sum(r.passed for r in fsdp_cells)}/{len(fsdp_cells)} FSDP-control cells pass, "
        f"{sum(r.passed for r in variant_cells)}/{len(variant_cells)} model-variant cells pass, "
        f"{sum(r.passed for r in value_cells)}/{len(value_cells)} value-model cells pass, "
        f"{sum(not r.passed for r in controls)}/{len(controls)} controls fail as they must; "
        f"{seconds:.1f}s"
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    """CLI: print the parity table for the matrix (and the negative controls)."""
    args = _parse_args(argv)
    layouts = [tuple(int(x) for x in item.split("x")) for item in args.layouts.split(",")]
    torch.set_num_threads(1)
    settings = ParitySettings()
    if args.model_path:
        settings = ParitySettings(model=load_model_config(name=None, path=args.model_path, vocab_size=1))
        print(f"model: {args.model_path} ({type(settings.model).__name__})")
    start = time.perf_counter()
    results = run_layouts(
        jobs=parity_jobs(
            layouts=layouts,
            controls=not args.no_controls,
            fsdp=not args.no_fsdp,
            variants=not args.no_variants,
            values=not args.no_values,
        ),
        settings=settings,
    )
    return 0 if _report(results, seconds=time.perf_counter() - start) else 1


if __name__ == "__main__":
    sys.exit(main())
