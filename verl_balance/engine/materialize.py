"""Sharded model construction: parameters on ``meta``, ``fully_shard`` into Shard(0) DTensors over
the flattened (dp, sp) mesh, ``to_empty`` for each rank's rows only, then filled; at most one full
tensor (a parameter's random draw on the host) exists at a time.

Invariants:
- every parameter's full value is a function of (seed, model) only; dp/sp change who holds a row;
  built-in presets are bit-identical to ``torch.manual_seed(seed); build_model(config)``;
- buffers are built for real and written back after ``to_empty``;
- tied embeddings stay one Parameter;
- LoRA adapters: A from (seed, parameter name), B = 0, or this rank's rows of lora_adapter_path.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import math
import os
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from verl_balance.engine import lora as lora_module
from verl_balance.engine.lora import base_name, is_lora_name
from verl_balance.models import ModelConfig, build_model
from verl_balance.models.base import PackedCausalLM
from verl_balance.models.config import ModelConfigError
from verl_balance.models.safetensors_io import checkpoint_key, expert_sources, safetensors_key_files
from verl_balance.models.value import VALUE_HEAD_NAMES, checkpoint_has_value_head


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Move every Parameter registered inside the block to meta; buffers keep their real values."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)
            module._parameters[name] = meta

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def build_meta_model(model_config, *, sp_size: int, attn_impl: str, value_head: bool = False) -> PackedCausalLM:
    """The model (or its ``ValueModel``) with every parameter on ``meta``, buffers on the host; no file is read."""
    from dataclasses import replace

    from verl_balance.models.value import build_value_model

    if getattr(model_config, "init", None) == "pretrained":
        model_config = replace(model_config, init="random")
    build = build_value_model if value_head else build_model
    # Large empty host tensors created and dropped here are never touched (no resident pages).
    with parameters_on_meta(), torch.random.fork_rng(devices=[]):
        return build(model_config, sp_size=sp_size, attn_impl=attn_impl)


def local_rows(param: Tensor) -> tuple[int, int]:
    """(first row, number of rows) of ``param`` held by this rank."""
    if not isinstance(param, DTensor):
        return 0, param.shape[0] if param.dim() else 1
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    assert tuple(shape[1:]) == tuple(param.shape[1:]), f"expected a Shard(0) layout, got {param.placements}"
    return offset[0], shape[0]


def _local(param: Tensor) -> Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


@torch.no_grad()
def copy_local_rows(param: Tensor, full_or_rows: Tensor, *, rows_only: bool = False) -> None:
    """Write this rank's rows (of a full tensor, or just the rows with ``rows_only``) into ``param``."""
    start, count = local_rows(param)
    local = _local(param)
    if param.dim() == 0:
        local.copy_(full_or_rows)
        return
    if count == 0:
        return
    src = full_or_rows if rows_only else full_or_rows[start : start + count]
    local.copy_(src.to(dtype=local.dtype))


def unique_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(first name, parameter) once per Parameter object (a tied weight appears once)."""
    return list(model.named_parameters(remove_duplicate=True))


# ---------------------------------------------------------------------------- random weights
def fill_builtin_random(model: nn.Module, *, seed: int) -> None:
    """Built-in decoder: the exact weights of ``torch.manual_seed(seed); LlamaForCausalLM(config)``,
    one full tensor at a time (a ``ValueModel``'s backbone too; its ``score`` is not drawn here)."""
    std = model.config.initializer_range
    owners = {
        f"{prefix}.{n}" if prefix else n: m
        for prefix, m in model.named_modules()
        for n, _ in m.named_parameters(recurse=False)
    }
    skip = getattr(model, "head_parameter_names", ())
    # (name, shape, construction draw, parameter or None for a dropped one)
    entries = [
        (name, tuple(param.shape), _construction_draw(owners[name]), param)
        for name, param in unique_parameters(model)
        if name not in skip
    ]
    entries += [(name, shape, "linear", None) for name, shape in getattr(model, "dropped_parameters", {}).items()]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _, shape, draw, _ in entries:
            scratch = torch.empty(shape)
            if draw == "embedding":
                nn.init.normal_(scratch)
            elif draw == "linear":
                nn.init.kaiming_uniform_(scratch, a=math.sqrt(5))
            del scratch
        for name, shape, _, param in entries:
            if param is None:
                continue  # the last draws of construction: nothing after them needs the RNG
            full = torch.empty(shape)
            if name.endswith("norm.weight"):
                nn.init.ones_(full)
            else:
                nn.init.normal_(full, mean=0.0, std=std)
            copy_local_rows(param, full)
            del full


def _construction_draw(owner: nn.Module) -> str | None:
    if isinstance(owner, nn.Embedding):
        return "embedding"
    return "linear" if isinstance(owner, nn.Linear) else None


def module_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (run seed, module name): independent of layout and of module order."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def leaf_twins(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, meta copy) of each module that owns parameters directly, taken before sharding."""
    twins = []
    for name, module in model.named_modules():
        if is_lora_name(name):
            continue  # LoRA adapters are filled by fill_lora
        if next(module.parameters(recurse=False), None) is not None:
            twin = copy.copy(module)
            twin._modules = {}
            twin._parameters = {k: copy.deepcopy(v) for k, v in module._parameters.items()}
            twin._buffers = {}
            twins.append((name, twin))
    return twins


@torch.no_grad()
def fill_hf_random(model: nn.Module, twins: list[tuple[str, nn.Module]], *, seed: int) -> None:
    """HF model: each leaf module's parameters from HF's ``_init_weights``, seeded by (seed, module name)."""
    init_weights: Callable[[nn.Module], None] = model.hf_model._init_weights
    params = dict(model.named_parameters(remove_duplicate=False))
    done: set[int] = set()
    for module_name, twin in twins:
        targets = {
            n: params[f"{module_name}.{n}" if module_name else n] for n, p in twin._parameters.items() if p is not None
        }
        if all(id(p) in done for p in targets.values()):
            continue
        twin.to_empty(device="cpu")
        for p in twin.parameters(recurse=False):
            p.__dict__.pop("_is_hf_initialized", None)
        with torch.random.fork_rng(devices=[]):
            # The HF name (without LoRA's ".base_layer"): a LoRA model gets the same base weights.
            torch.manual_seed(module_seed(seed, base_name(module_name)))
            init_weights(twin)
        for n, target in targets.items():
            if id(target) not in done:
                copy_local_rows(target, twin._parameters[n].detach())
                done.add(id(target))
        twin.to_empty(device="meta")


# ---------------------------------------------------------------------------- pretrained weights
@torch.no_grad()
def fill_pretrained(model: nn.Module, path: str, *, skip: tuple[str, ...] = ()) -> None:
    """Write this rank's rows of every parameter (but ``skip``) from the safetensors of ``path``,
    reading only this rank's MoE experts. ModelConfigError for a missing tensor or shape mismatch."""
    files = safetensors_key_files(path)
    for name, param in unique_parameters(model):
        if is_lora_name(name) or name in skip:
            continue  # LoRA adapters are filled by fill_lora
        name = base_name(name)
        key = checkpoint_key(name, files)
        if key is not None:
            _fill_from_key(param, name=name, key=key, file=files[key])
            continue
        sources = expert_sources(name, files)
        if sources is None:
            raise ModelConfigError(f"model.path={path!r}: the safetensors have no tensor {name!r}")
        _fill_from_experts(param, name=name, sources=sources, files=files)


def _fill_from_key(param: nn.Parameter, *, name: str, key: str, file: str) -> None:
    from safetensors import safe_open

    # Opened per tensor: the file's mapped pages this rank touched are released after each
    # tensor, so they never add up to the rank's whole share of the file in its RSS.
    with safe_open(file, framework="pt") as f:
        tensor_slice = f.get_slice(key)
        shape = tuple(tensor_slice.get_shape())
        if shape != tuple(param.shape):
            raise ModelConfigError(
                f"{file}: tensor {key!r} has shape {shape}, the model's {name!r} has {tuple(param.shape)}"
            )
        if not shape:
            copy_local_rows(param, f.get_tensor(key))
            return
        start, count = local_rows(param)
        if count:
            copy_local_rows(param, tensor_slice[start : start + count], rows_only=True)


def _fill_from_experts(param: nn.Parameter, *, name: str, sources: list[list[str]], files: dict[str, str]) -> None:
    """Fill rows [start, start + count) of a fused expert parameter from the per-expert tensors."""
    from safetensors import safe_open

    if len(sources) != param.shape[0]:
        raise ModelConfigError(f"{name!r} holds {param.shape[0]} experts, the safetensors {len(sources)}")
    start, count = local_rows(param)
    experts = []
    for keys in sources[start : start + count]:
        parts = []
        for key in keys:
            with safe_open(files[key], framework="pt") as f:
                parts.append(f.get_tensor(key))
        experts.append(torch.cat(parts, dim=0))
    if experts:
        rows = torch.stack(experts)
        if tuple(rows.shape[1:]) != tuple(param.shape[1:]):
            raise ModelConfigError(
                f"{name!r} has expert shape {tuple(param.shape[1:])}, the safetensors give {tuple(rows.shape[1:])} "
                f"(from {sources[start]})"
            )
        copy_local_rows(param, rows, rows_only=True)


# ---------------------------------------------------------------------------- LoRA adapters
@torch.no_grad()
def fill_lora_params(model: nn.Module, *, seed: int) -> None:
    """This rank's rows of every adapter: A kaiming-uniform seeded by (seed, name), B zero."""
    for name, param in model.named_parameters():
        if not lora_module.is_lora_name(name):
            continue
        full = torch.zeros(tuple(param.shape))
        if ".lora_A." in name:
            generator = torch.Generator().manual_seed(module_seed(seed, name))
            bound = 1.0 / math.sqrt(param.shape[1])  # kaiming_uniform_(a=sqrt(5)) on [r, in]
            full.uniform_(-bound, bound, generator=generator)
        copy_local_rows(param, full)


@torch.no_grad()
def fill_lora_from_adapter(model: nn.Module, path: str) -> None:
    """This rank's rows of every adapter from ``path``/adapter_model.safetensors (peft's key names)."""
    from safetensors import safe_open

    file = os.path.join(path, lora_module.ADAPTER_WEIGHTS_FILE)
    with safe_open(file, framework="pt") as f:
        keys = set(f.keys())
        for name, param in model.named_parameters():
            if not lora_module.is_lora_name(name):
                continue
            key = lora_module.peft_key(name)
            if key not in keys:
                raise lora_module.EngineConfigError(
                    f"lora_adapter_path={path!r}: {lora_module.ADAPTER_WEIGHTS_FILE} has no tensor {key!r}"
                )
            tensor_slice = f.get_slice(key)
            if tuple(tensor_slice.get_shape()) != tuple(param.shape):
                raise lora_module.EngineConfigError(
                    f"lora_adapter_path={path!r}: {key!r} has shape {tuple(tensor_slice.get_shape())}, "
                    f"the model's adapter {tuple(param.shape)}"
                )
            start, count = local_rows(param)
            if count:
                copy_local_rows(param, tensor_slice[start : start + count], rows_only=True)


def fill_lora(model: nn.Module, config) -> None:
    """The adapters' values: from lora_adapter_path, else from the seed."""
    if config.lora_adapter_path:
        fill_lora_from_adapter(model, config.lora_adapter_path)
    else:
        fill_lora_params(model, seed=config.seed)


# ---------------------------------------------------------------------------- construction
def shard_model(
    model: nn.Module, *, mesh, param_dtype: torch.dtype, reshard_after_forward: bool, offload_policy=None
) -> None:
    """FSDP2 over ``mesh``: one unit per ``fsdp_units()`` module, then the root."""
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    kwargs = dict(mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    for unit in model.fsdp_units():
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)


def buffers_to(model: nn.Module, device: torch.device) -> None:
    """Move every buffer (not the parameters) to ``device``."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = buf.to(device)


def build_sharded_model(
    model_config,
    *,
    seed: int,
    sp_size: int,
    attn_impl: str,
    device: torch.device,
    shard: Callable[[nn.Module], None] | None,
    lora=None,
    value_head: bool = False,
    offload: bool = False,
) -> PackedCausalLM:
    """Meta build -> LoRA adapters -> ``shard`` (None: the plain module) -> local storage on
    ``device`` -> weights. With ``offload`` parameters stay on the CPU, buffers go to ``device``.
    ``model.set_sequence_parallel_group`` is the caller's."""
    from verl_balance.models.hf import HFModelConfig

    model = build_meta_model(model_config, sp_size=sp_size, attn_impl=attn_impl, value_head=value_head)
    if lora is not None:
        lora_module.apply_lora(model, lora)
    buffers = {name: buf.clone() for name, buf in model.named_buffers()}
    pretrained = isinstance(model_config, HFModelConfig) and model_config.init == "pretrained"
    twins = leaf_twins(model) if isinstance(model_config, HFModelConfig) and not pretrained else []
    if shard is not None:
        shard(model)
    ties = tied_parameter_names(model)
    model.to_empty(device=torch.device("cpu") if offload else device)
    retie(model, ties)
    restore_buffers(model, buffers)
    if offload:
        buffers_to(model, device)
    head_loaded = value_head and pretrained and checkpoint_has_value_head(model_config.path)
    if pretrained:
        fill_pretrained(model, model_config.path, skip=() if head_loaded or not value_head else VALUE_HEAD_NAMES)
    elif isinstance(model_config, ModelConfig):
        fill_builtin_random(model, seed=seed)
    else:
        fill_hf_random(model, twins, seed=seed)
    if value_head and not head_loaded:
        fill_value_head(model, seed=seed)
    if lora is not None:
        fill_lora(model, lora)
    return model


def value_head_init(name: str, shape: tuple[int, ...], *, seed: int, std: float) -> Tensor:
    """The full initial value of value-head parameter ``name``: weight ~ Normal(0, std) seeded by
    (seed, name), bias 0; the same at every layout."""
    full = torch.zeros(shape)
    if name.endswith("weight"):
        full.normal_(0.0, std, generator=torch.Generator().manual_seed(module_seed(seed, name)))
    return full


@torch.no_grad()
def fill_value_head(model: nn.Module, *, seed: int) -> None:
    """This rank's rows of the value head (``value_head_init``: from (seed, name))."""
    for name in VALUE_HEAD_NAMES:
        param = model.get_parameter(name)
        copy_local_rows(param, value_head_init(name, tuple(param.shape), seed=seed, std=model.initializer_range))


def tied_parameter_names(model: nn.Module) -> dict[str, str]:
    """Alias name -> first name of every Parameter registered under more than one name."""
    first: dict[int, str] = {}
    ties = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            ties[name] = first[id(param)]
        else:
            first[id(param)] = name
    return ties


def retie(model: nn.Module, ties: dict[str, str]) -> None:
    """Point every alias at its first name's Parameter again (``to_empty`` unties them)."""
    for alias, name in ties.items():
        owner, _, leaf = alias.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module._parameters[leaf] = model.get_parameter(name)


@torch.no_grad()
def restore_buffers(model: nn.Module, buffers: dict[str, Tensor]) -> None:
    """Write the construction-time buffer values back (``to_empty`` left them uninitialised)."""
    for name, buf in model.named_buffers():
        _local(buf).copy_(buffers[name].to(buf.device))
