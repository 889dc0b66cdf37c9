"""Write a (sharded) engine model as a Hugging Face save_pretrained directory, one tensor at a time.

Collective over the model's mesh: for each parameter in turn every rank joins the all-gather of that
one tensor (``DTensor.full_tensor``); rank 0 alone keeps it, buffering at most one safetensors file
(``max_shard_bytes``) before writing it. No rank ever holds the whole model: peak extra host memory
is one full tensor on every rank, plus one file's worth of tensors on rank 0.

A built-in model is written as transformers' Llama (same math; names mapped by
``models.hf_llama.builtin_to_hf_llama``). Tied embeddings are one parameter, written once. A LoRA
model (engine/lora.py) is written merged: each adapted weight as W + scaling * B @ A (fp32).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from verl_balance.engine.lora import adapter_names, base_name, is_lora_name, lora_scaling, merged_weight
from verl_balance.engine.materialize import unique_parameters
from verl_balance.models.config import ModelConfig
from verl_balance.models.hf_llama import builtin_to_hf_llama
from verl_balance.models.safetensors_io import DEFAULT_MAX_SHARD_BYTES, TensorSpec, save_hf_directory
from verl_balance.models.value import ValueModel


def hf_names_and_config(model_config, names: list[str]):
    """(our name -> HF name, transformers config) for the model's parameter ``names``."""
    if isinstance(model_config, ModelConfig):
        # builtin_to_hf_llama maps a state dict; mapping names to themselves yields HF name -> ours.
        hf_config, hf_to_ours = builtin_to_hf_llama({n: n for n in names}, model_config=model_config)
        hf_config.architectures = ["LlamaForCausalLM"]
        return {ours: hf for hf, ours in hf_to_ours.items()}, hf_config
    return {n: n for n in names}, model_config.hf_config()


def value_model_hf_config(model: ValueModel, hf_config) -> None:
    """A value model is written as HF's ``<Family>ForTokenClassification`` with ``num_labels=1``
    (what verl's critic loads): ``score`` under its own name, no ``lm_head``."""
    family = type(model.hf_model).__name__.removesuffix("ForCausalLM")
    hf_config.architectures = [f"{family}ForTokenClassification"]
    hf_config.num_labels = 1


def save_engine_model_as_hf(
    model: torch.nn.Module,
    *,
    model_config,
    out: str,
    tokenizer_path: str | None = None,
    group: dist.ProcessGroup | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write ``model`` (FSDP2-sharded or plain) under ``out`` from rank 0 of ``group``; collective:
    call on every rank of the model's mesh. Ends with a barrier over ``group``."""
    if isinstance(model, ValueModel) and getattr(model, "hf_model", None) is None:
        raise ValueError("a built-in value model has no Hugging Face export; give the critic an HF model.path")
    lora = getattr(model, "lora_config", None)
    by_name = dict(unique_parameters(model))
    # A LoRA model is written merged (W + scaling * B @ A under the base weight's HF name).
    params = [(n, p) for n, p in by_name.items() if not is_lora_name(n)]
    names, hf_config = hf_names_and_config(model_config, [base_name(n) for n, _ in params])
    if isinstance(model, ValueModel):
        value_model_hf_config(model, hf_config)
    missing = sorted({base_name(n) for n, _ in params} - set(names))
    if missing:
        raise ValueError(f"parameters without an HF name: {missing[:5]}")
    names = {n: names[base_name(n)] for n, _ in params}
    is_writer = not dist.is_initialized() or dist.get_rank(group) == 0
    specs = [TensorSpec(names[n], tuple(p.shape), torch.float32 if lora else p.dtype) for n, p in params]

    def full(param):
        return (param.full_tensor() if isinstance(param, DTensor) else param).detach()

    def gathered():
        for name, param in params:
            tensor = full(param)
            pair = adapter_names(name) if lora is not None else None
            if pair is not None and pair[0] in by_name:
                a, b = full(by_name[pair[0]]), full(by_name[pair[1]])
                tensor = merged_weight(tensor, a, b, scaling=lora_scaling(lora))
            if is_writer:
                yield names[name], tensor.cpu()
            del tensor

    if is_writer:
        save_hf_directory(
            out,
            hf_config=hf_config,
            specs=specs,
            tensors=gathered(),
            tokenizer_path=tokenizer_path or getattr(model_config, "path", None),
            max_shard_bytes=max_shard_bytes,
        )
    else:
        for _ in gathered():
            pass
    if dist.is_initialized():
        dist.barrier(group=group)
