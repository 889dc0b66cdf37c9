"""LoRA adapters (peft) on an HF engine model, injected on the meta model before FSDP2 sharding.

Each target ``nn.Linear`` becomes peft's ``lora.Linear`` without the PeftModel wrapper, so names keep
HF's prefix (``...q_proj.base_layer.weight`` frozen, ``...q_proj.lora_A.default.weight`` trainable).

Invariants:
- Base weights are the model's own, so a LoRA model with B = 0 computes exactly the base logits.
- Adapter weights are a function of (seed, parameter name) only, or ``lora_adapter_path``'s rows.
- The output head and embeddings never get an adapter; an unknown target is refused.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from verl_balance.engine.config import EngineConfig, EngineConfigError

ADAPTER = "default"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def base_name(name: str) -> str:
    """The HF name of a (possibly LoRA-wrapped) parameter or module name."""
    return name.replace(".base_layer", "")


def is_lora_name(name: str) -> bool:
    """True for a LoRA adapter parameter or module (lora_A / lora_B)."""
    return ".lora_A." in name or ".lora_B." in name or name.endswith((".lora_A", ".lora_B"))


def peft_key(name: str) -> str:
    """Our adapter parameter name -> the key peft's adapter_model.safetensors uses."""
    return PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")


def linear_module_names(model: nn.Module) -> list[str]:
    """Leaf names of the decoder's nn.Linear modules (what target_modules may name)."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.model.named_modules() if isinstance(m, nn.Linear)})


def lora_peft_config(config: EngineConfig, model: nn.Module):
    """The peft LoraConfig of ``config``; EngineConfigError for a target the decoder does not have."""
    from peft import LoraConfig

    if config.lora_adapter_path:
        return adapter_lora_config(config.lora_adapter_path)
    valid = linear_module_names(model)
    targets = config.target_modules
    if isinstance(targets, str):
        if targets != "all-linear":
            targets = [targets]
    else:
        targets = [str(t) for t in targets]
    if targets != "all-linear":
        unknown = [t for t in targets if t not in valid]
        if unknown or not targets:
            raise EngineConfigError(
                f"target_modules={list(targets)}: {unknown or 'empty'} is not a Linear module of the decoder; "
                f"valid: 'all-linear' or a list of {valid}"
            )
    exclude = config.exclude_modules
    if exclude is not None and not isinstance(exclude, str):
        exclude = [str(e) for e in exclude]
    return LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        target_modules=targets,
        exclude_modules=exclude,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )


def adapter_lora_config(path: str):
    """The LoraConfig of a peft adapter directory; EngineConfigError naming lora_adapter_path."""
    from peft import LoraConfig

    for name in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE):
        if not os.path.isfile(os.path.join(path, name)):
            raise EngineConfigError(f"lora_adapter_path={path!r} has no {name} (a peft adapter directory)")
    with open(os.path.join(path, ADAPTER_CONFIG_FILE)) as f:
        raw = json.load(f)
    if raw.get("lora_dropout", 0.0) or raw.get("use_dora") or raw.get("bias", "none") != "none":
        raise EngineConfigError(
            f"lora_adapter_path={path!r}: only plain LoRA adapters (lora_dropout=0, bias='none', no DoRA) are supported"
        )
    lora = LoraConfig.from_pretrained(path)
    lora.inference_mode = False
    return lora


def apply_lora(model: nn.Module, config: EngineConfig) -> None:
    """Inject LoRA adapters into ``model`` (an HFCausalLM, typically on meta) in place; only the
    adapters stay trainable. EngineConfigError for a built-in model."""
    from peft import inject_adapter_in_model

    if not hasattr(model, "hf_model"):
        raise EngineConfigError(
            f"lora_rank={config.lora_rank}: LoRA needs a Hugging Face model (model.path); the built-in model "
            "has no LoRA support, set lora_rank=0"
        )
    lora = lora_peft_config(config, model)
    inject_adapter_in_model(lora, model.hf_model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_(is_lora_name(name))
    if not any(p.requires_grad for p in model.parameters()):
        raise EngineConfigError(f"target_modules / exclude_modules leave no module with a LoRA adapter ({lora})")
    model.lora_config = lora


# ---------------------------------------------------------------------------- export
def lora_scaling(lora) -> float:
    """peft's factor on B @ A: lora_alpha / r (lora_alpha / sqrt(r) with use_rslora)."""
    r = lora.r
    return lora.lora_alpha / (math.sqrt(r) if getattr(lora, "use_rslora", False) else r)


def adapter_names(name: str) -> tuple[str, str] | None:
    """(lora_A, lora_B) parameter names of a LoRA-wrapped base weight ``name``; None otherwise."""
    suffix = ".base_layer.weight"
    if not name.endswith(suffix):
        return None
    prefix = name[: -len(suffix)]
    return f"{prefix}.lora_A.{ADAPTER}.weight", f"{prefix}.lora_B.{ADAPTER}.weight"


def merged_weight(base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, *, scaling: float) -> torch.Tensor:
    """W + scaling * B @ A in fp32 (what peft's merge_and_unload computes)."""
    return base.float() + scaling * (lora_b.float() @ lora_a.float())


def merged_state_dict(state: dict[str, torch.Tensor], lora) -> dict[str, torch.Tensor]:
    """Full tensors of a LoRA model (our names) -> the plain HF model's state with adapters merged."""
    scaling = lora_scaling(lora)
    out = {}
    for name, tensor in state.items():
        if is_lora_name(name):
            continue
        pair = adapter_names(name)
        if pair is not None and pair[0] in state:
            tensor = merged_weight(tensor, state[pair[0]], state[pair[1]], scaling=scaling)
        out[base_name(name)] = tensor
    return out


def lora_config_dict(lora, *, base_model_path: str | None = None) -> dict:
    """The JSON of adapter_config.json (peft's fields)."""
    config = lora.to_dict()
    config["base_model_name_or_path"] = base_model_path
    config["inference_mode"] = True
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


def save_lora_config(lora, directory: str, *, base_model_path: str | None = None) -> None:
    """Write ``directory``/adapter_config.json."""
    with open(os.path.join(directory, ADAPTER_CONFIG_FILE), "w") as f:
        json.dump(lora_config_dict(lora, base_model_path=base_model_path), f, indent=2, sort_keys=True, default=str)


def save_adapter_dir(out: str, state: dict[str, torch.Tensor], lora, *, base_model_path: str | None) -> str:
    """Write a peft adapter directory from the full tensors ``state`` (our names)."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    tensors = {peft_key(n): t.detach().float().contiguous().cpu() for n, t in state.items() if is_lora_name(n)}
    save_file(tensors, os.path.join(out, ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    save_lora_config(lora, out, base_model_path=base_model_path)
    return out


# ---------------------------------------------------------------------------- reference policy
@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as its base model (every LoRA layer computes ``base_layer(x)``). Forward-only;
    requires_grad is restored on exit."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


# ---------------------------------------------------------------------------- checkpoint base fingerprint
BASE_FINGERPRINT_FILE = "base_fingerprint.json"
_MODEL_CONFIG_FIELDS_WITHOUT_WEIGHTS = ("path", "enable_gradient_checkpointing")


class BaseMismatchError(ValueError):
    """A LoRA checkpoint's adapters were trained on another frozen base than the one at hand."""


def base_weight_files(path: str) -> list[str]:
    """The weight-defining files of an HF model directory (relative names, sorted)."""
    names = []
    for name in sorted(os.listdir(path)):
        if name == "config.json" or name.endswith((".safetensors", ".bin", ".index.json")):
            names.append(name)
    return names


def base_fingerprint(model_config, *, seed: int) -> dict:
    """What a LoRA run's frozen base came from: the model directory and its weight files' checksums,
    or the seed and the model config."""
    import dataclasses

    from verl_balance.utils.checksums import hash_files

    path = getattr(model_config, "path", None)
    if path and getattr(model_config, "init", None) == "pretrained":
        path = os.path.abspath(path)
        return {"kind": "model_directory", "path": path, "files": hash_files(path, base_weight_files(path))}
    fields = dataclasses.asdict(model_config).items()
    config = {k: v for k, v in fields if k not in _MODEL_CONFIG_FIELDS_WITHOUT_WEIGHTS}
    return {"kind": "seeded", "seed": seed, "model_config": config}


def describe_base(fingerprint: dict) -> str:
    if fingerprint.get("kind") == "model_directory":
        return f"model directory {fingerprint['path']!r}"
    return f"seed {fingerprint.get('seed')} with model config {fingerprint.get('model_config')}"


def fingerprint_problems(saved: dict, current: dict) -> list[str]:
    """How ``current`` differs from ``saved`` ([] when the same base, even if moved)."""
    if saved.get("kind") != current.get("kind"):
        return [f"the base kind differs ({saved.get('kind')} vs {current.get('kind')})"]
    if saved["kind"] != "model_directory":
        return [] if saved == current else ["the seed or the model config differs"]
    root = current["path"]
    problems = []
    for name in sorted(set(saved["files"]) | set(current["files"])):
        was, now = saved["files"].get(name), current["files"].get(name)
        full = os.path.join(root, name)
        if now is None or now.get("missing"):
            problems.append(f"{full} is missing (the checkpoint's base had it)")
        elif was is None:
            problems.append(f"{full} is new (the checkpoint's base had no such file)")
        elif (was.get("size"), was.get("xxh3_128")) != (now.get("size"), now.get("xxh3_128")):
            problems.append(
                f"{full} changed ({now.get('size')} bytes, xxh3_128 {now.get('xxh3_128')}; the checkpoint's base: "
                f"{was.get('size')} bytes, xxh3_128 {was.get('xxh3_128')})"
            )
    return problems


def base_mismatch_message(checkpoint: str, saved: dict, current: dict) -> str | None:
    """The refusal text when ``current`` is not the base ``checkpoint``'s adapters were trained on."""
    problems = fingerprint_problems(saved, current)
    if not problems:
        return None
    return (
        f"LoRA checkpoint {checkpoint!r} holds adapters trained on the {describe_base(saved)}, but the base at hand "
        f"is the {describe_base(current)}: {'; '.join(problems)}. Use the base the checkpoint was trained on."
    )


def read_base_fingerprint(checkpoint: str) -> dict | None:
    """The checkpoint's base_fingerprint.json; None for a checkpoint without one (a full one)."""
    path = os.path.join(checkpoint, BASE_FINGERPRINT_FILE)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)
