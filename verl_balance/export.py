"""Export a training checkpoint of a Hugging Face model as a ``save_pretrained`` directory.

    python -m verl_balance.export CHECKPOINT OUT [--model-path DIR | --builtin-config CONFIG.json]
                                  [--overwrite] [--allow-incomplete] [--merge-lora]

Invariants:
- The checkpoint must be complete and match its recorded checksums before anything is read
  (``--allow-incomplete``: without the record, unverified).
- A non-empty OUT is refused unless ``--overwrite``; the export is staged and renamed into place
  once complete, so a failure leaves nothing half-written.
- A LoRA checkpoint becomes a peft adapter (``--merge-lora``: the merged model).
- The whole fp32 model is held in host memory (4 * P bytes), none on a GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import replace

import torch

from verl_balance.models.config import ModelConfig, ModelConfigError
from verl_balance.models.hf import HFModelConfig, build_hf_model
from verl_balance.models.hf_llama import builtin_to_hf_llama, save_builtin_as_hf_llama  # noqa: F401 (re-exported)
from verl_balance.models.llama import LlamaForCausalLM
from verl_balance.models.safetensors_io import DEFAULT_MAX_SHARD_BYTES, TensorSpec, save_hf_directory, share_files
from verl_balance.utils import checksums, safe_load
from verl_balance.utils.atomic_io import fsync_dir

logger = logging.getLogger(__name__)

TRAINER_STATE_FILE = "trainer_state.json"


class ExportError(ValueError):
    """A checkpoint or model directory that cannot be exported."""


def save_hf_pretrained(
    state_dict: Mapping[str, torch.Tensor],
    *,
    model_config: HFModelConfig,
    out: str,
    tokenizer_path: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> str:
    """Write ``state_dict`` (HF names, full tensors) as a save_pretrained directory of fp32 safetensors
    shards of at most ``max_shard_bytes``, with config and tokenizer; a tied ``lm_head.weight`` is not
    written."""
    from verl_balance.engine.materialize import parameters_on_meta

    with parameters_on_meta(), torch.random.fork_rng(devices=[]):
        skeleton = build_hf_model(replace(model_config, init="random"), attn_implementation="sdpa")
    expected = dict(skeleton.named_parameters())  # a tied lm_head.weight appears once, as embed_tokens
    state = dict(state_dict)
    if model_config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        raise ExportError(
            f"state dict does not match {model_config.model_type} at {model_config.path!r}: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ExportError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}")
    specs = [TensorSpec(name, tuple(p.shape), torch.float32) for name, p in expected.items()]
    tensors = ((name, state[name].detach().to(device="cpu", dtype=torch.float32)) for name in expected)
    return save_hf_directory(
        out,
        hf_config=model_config.hf_config(),
        specs=specs,
        tensors=tensors,
        tokenizer_path=tokenizer_path or model_config.path,
        max_shard_bytes=max_shard_bytes,
    )


def checkpoint_lora_config(checkpoint: str):
    """The peft LoraConfig of a LoRA run's checkpoint (its adapter_config.json); None otherwise."""
    from verl_balance.engine.lora import ADAPTER_CONFIG_FILE

    if not os.path.exists(os.path.join(checkpoint, ADAPTER_CONFIG_FILE)):
        return None
    from peft import LoraConfig

    return LoraConfig.from_pretrained(checkpoint)


def _skeleton_state(model_config, lora) -> dict[str, torch.Tensor]:
    """The model's state dict with random weights (names and shapes), LoRA-wrapped when ``lora``."""
    with torch.random.fork_rng(devices=[]):
        if isinstance(model_config, ModelConfig):
            return LlamaForCausalLM(model_config).state_dict()
        model = build_hf_model(replace(model_config, init="random"), attn_implementation="sdpa")
        if lora is not None:
            from peft import inject_adapter_in_model

            from verl_balance.engine.lora import ADAPTER

            inject_adapter_in_model(lora, model, adapter_name=ADAPTER)
        return model.state_dict()


def load_checkpoint_model_state(
    checkpoint: str, *, model_config, lora=None, base_state: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Full (unsharded) model tensors of a DCP engine checkpoint, in this process only; a LoRA checkpoint's
    frozen base comes from ``base_state`` (without it only the adapters are returned)."""
    if not os.path.exists(os.path.join(checkpoint, ".metadata")):
        raise ExportError(
            f"{checkpoint!r} is not an engine checkpoint (no DCP .metadata); pass a global_step_N directory"
        )
    metadata = safe_load.read_dcp_metadata(checkpoint)  # a planted pickle: UnsafeCheckpointError
    saved = {k.split(".", 1)[1] for k in metadata.state_dict_metadata if k.startswith("model.")}
    skeleton = base_state if base_state is not None else _skeleton_state(model_config, lora)
    wanted = {k: v for k, v in skeleton.items() if k in saved}
    optional = _base_keys(skeleton) if _is_adapter_checkpoint(checkpoint) else set()
    absent = [
        k
        for k in skeleton
        if k not in saved and k not in optional and not (model_config.tie_word_embeddings and k == "lm_head.weight")
    ]
    if absent:
        raise ExportError(
            f"checkpoint {checkpoint!r} lacks {absent[:5]}: it was not trained with this model "
            f"config ({getattr(model_config, 'path', model_config)})"
        )
    state = {"model": {k: v.clone() for k, v in wanted.items()}}
    truncated = checksums.dcp_truncated_files(checkpoint)
    if truncated:
        raise ExportError(f"checkpoint {checkpoint!r} is corrupt: {'; '.join(truncated)}")
    try:
        safe_load.dcp_load(state, checkpoint, no_dist=True)
    except safe_load.UnsafeCheckpointError:
        raise
    except Exception as err:  # DCP names no file (EOFError, "PytorchStreamReader failed ..."): say which
        raise ExportError(f"reading the DCP shards of checkpoint {checkpoint!r} failed: {err!r}") from err
    if base_state is None:
        return state["model"]
    return {**base_state, **state["model"]}


def _is_adapter_checkpoint(checkpoint: str) -> bool:
    """A LoRA checkpoint that holds only the adapters (it records its base in base_fingerprint.json)."""
    from verl_balance.engine.lora import BASE_FINGERPRINT_FILE

    return os.path.exists(os.path.join(checkpoint, BASE_FINGERPRINT_FILE))


def _base_keys(state: dict) -> set[str]:
    from verl_balance.engine.lora import is_lora_name

    return {k for k in state if not is_lora_name(k)}


def check_lora_base(checkpoint: str, model_config) -> dict | None:
    """Refuse a base directory other than the adapters' (naming changed files); returns the fingerprint."""
    from verl_balance.engine.lora import base_fingerprint, base_mismatch_message, read_base_fingerprint

    saved = read_base_fingerprint(checkpoint)
    if saved is None or saved.get("kind") != "model_directory":
        return saved
    message = base_mismatch_message(checkpoint, saved, base_fingerprint(model_config, seed=0))
    if message is not None:
        raise ExportError(message)
    return saved


def lora_base_state(model_config, lora) -> dict[str, torch.Tensor]:
    """The frozen base of a LoRA model from its directory, under the engine's LoRA names."""
    from peft import inject_adapter_in_model

    from verl_balance.engine.lora import ADAPTER

    with torch.random.fork_rng(devices=[]):
        model = build_hf_model(replace(model_config, init="pretrained"), attn_implementation="sdpa")
        inject_adapter_in_model(lora, model, adapter_name=ADAPTER)
    return model.state_dict()


def recorded_model_config(checkpoint: str) -> dict | None:
    """The ``model_config`` recorded in trainer_state.json (kind "hf" or "builtin"); None if absent."""
    trainer_state = os.path.join(checkpoint, TRAINER_STATE_FILE)
    if not os.path.exists(trainer_state):
        return None
    with open(trainer_state, encoding="utf-8") as f:
        state = json.load(f)
    recorded = state.get("model_config")
    if recorded is None and state.get("model_path"):
        recorded = {"kind": "hf", "path": state["model_path"]}
    return recorded


def verify_export_source(checkpoint: str, *, allow_incomplete: bool = False) -> None:
    """Refuse (naming the file) a checkpoint without a checksummed completeness record, or not matching it."""
    record_path = os.path.join(checkpoint, checksums.COMPLETE_FILE)
    if not os.path.exists(os.path.join(checkpoint, ".metadata")):
        return  # not a DCP checkpoint at all: load_checkpoint_model_state says so
    try:
        with open(record_path, encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        if not allow_incomplete:
            raise ExportError(
                f"{record_path} is missing: checkpoint {checkpoint!r} is not complete (its save was "
                "interrupted, or it was not written by the trainer); export a complete global_step_N, or "
                "pass --allow-incomplete to export it unverified"
            ) from None
        logger.warning("%s is missing: exporting %s unverified (--allow-incomplete)", record_path, checkpoint)
        return
    except ValueError as err:
        raise ExportError(f"{record_path} is not valid JSON ({err}): the checkpoint is not complete") from err
    manifest = record.get(checksums.MANIFEST_KEY) if isinstance(record, dict) else None
    if manifest is None:
        if not allow_incomplete:
            raise ExportError(
                f"{record_path} has no file checksums (an older version wrote it): checkpoint {checkpoint!r} "
                "cannot be verified; pass --allow-incomplete to export it unverified"
            )
        logger.warning(
            "%s has no file checksums: exporting %s unverified (--allow-incomplete)", record_path, checkpoint
        )
        return
    try:
        checksums.verify_manifest(checkpoint, manifest)
    except checksums.ChecksumMismatchError as err:
        raise ExportError(str(err)) from err


def _check_out(out: str, *, checkpoint: str, overwrite: bool) -> None:
    """Refuse an OUT that is not empty (unless ``overwrite``) or that overlaps the checkpoint."""
    out_abs, ckpt_abs = os.path.realpath(out), os.path.realpath(checkpoint)
    if os.path.commonpath([out_abs, ckpt_abs]) in (out_abs, ckpt_abs):
        raise ExportError(f"OUT {out!r} overlaps the checkpoint {checkpoint!r}; export to a directory outside it")
    if not os.path.lexists(out):
        return
    entries = sorted(os.listdir(out)) if os.path.isdir(out) else [os.path.basename(out)]
    if entries and not overwrite:
        raise ExportError(
            f"OUT {out!r} is not empty ({len(entries)} entries, e.g. {entries[:3]}); pass --overwrite to "
            "replace it (its old files are removed once the new export is complete), or choose a new directory"
        )


def _replace_with(staging: str, out: str) -> None:
    """Move ``staging`` to ``out``; an existing ``out`` is renamed aside and removed once the new one is in place."""
    parent = os.path.dirname(os.path.abspath(out))
    old = None
    if os.path.lexists(out):
        old = os.path.join(parent, f".{os.path.basename(out)}.old-{uuid.uuid4().hex[:8]}")
        os.rename(out, old)
    os.rename(staging, out)
    fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old) if os.path.isdir(old) and not os.path.islink(old) else os.remove(old)


def export_checkpoint(
    checkpoint: str,
    out: str,
    *,
    model_path: str | None = None,
    builtin_config: str | None = None,
    overwrite: bool = False,
    allow_incomplete: bool = False,
    merge_lora: bool = False,
) -> str:
    """Export ``checkpoint`` to ``out``; returns ``out``. An HF model needs ``model_path``, a built-in one
    ``builtin_config``; without either, the recorded model config is used."""
    _check_out(out, checkpoint=checkpoint, overwrite=overwrite)
    verify_export_source(checkpoint, allow_incomplete=allow_incomplete)
    target = os.path.abspath(out)  # no trailing slash: its basename names the staging directory
    os.makedirs(os.path.dirname(target), exist_ok=True)
    staging = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.staging-{uuid.uuid4().hex[:8]}")
    try:
        _write_export(checkpoint, staging, model_path=model_path, builtin_config=builtin_config, merge_lora=merge_lora)
        share_files(staging)  # the peft adapter directory's too
        _replace_with(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already after a successful rename
    return out


def _fingerprint_model_config(checkpoint: str) -> dict | None:
    """A LoRA checkpoint's recorded base model directory, as a recorded model config; None otherwise."""
    from verl_balance.engine.lora import read_base_fingerprint

    saved = read_base_fingerprint(checkpoint)
    if saved is None or saved.get("kind") != "model_directory":
        return None
    return {"kind": "hf", "path": saved["path"]}


def _write_export(
    checkpoint: str, out: str, *, model_path: str | None, builtin_config: str | None, merge_lora: bool = False
) -> str:
    """Read the checkpoint's model and write it to ``out`` (the staging directory)."""
    builtin: ModelConfig | None = None
    if builtin_config is not None:
        with open(builtin_config, encoding="utf-8") as f:
            builtin = ModelConfig(**json.load(f))
    elif model_path is None:
        recorded = recorded_model_config(checkpoint) or _fingerprint_model_config(checkpoint)
        if recorded is None:
            raise ExportError(
                f"checkpoint {checkpoint!r} does not record its model; pass --model-path DIR (the "
                "model.path it was trained from) or --builtin-config CONFIG.json"
            )
        fields = {k: v for k, v in recorded.items() if k != "kind"}
        if recorded.get("kind") == "builtin":
            builtin = ModelConfig(**fields)
        else:
            model_path = fields["path"]
    if builtin is not None:
        state = load_checkpoint_model_state(checkpoint, model_config=builtin)
        return save_builtin_as_hf_llama(state, model_config=builtin, out=out)
    try:
        model_config = HFModelConfig.from_pretrained(model_path)
    except ModelConfigError as err:
        raise ExportError(f"--model-path {model_path!r}: {err}") from err
    lora = checkpoint_lora_config(checkpoint)
    if merge_lora and lora is None:
        raise ExportError(f"--merge-lora: checkpoint {checkpoint!r} has no LoRA adapters (no adapter_config.json)")
    recorded_base = check_lora_base(checkpoint, model_config)
    base_state = None
    if merge_lora and recorded_base is not None:  # an adapters-only checkpoint: the base is the directory's
        if recorded_base.get("kind") != "model_directory":
            raise ExportError(
                f"--merge-lora: checkpoint {checkpoint!r} was trained on a base drawn from a seed "
                f"({recorded_base.get('kind')}), not read from a model directory; export the adapter instead"
            )
        base_state = lora_base_state(model_config, lora)
    state = load_checkpoint_model_state(checkpoint, model_config=model_config, lora=lora, base_state=base_state)
    if lora is None:
        return save_hf_pretrained(state, model_config=model_config, out=out)
    from verl_balance.engine.lora import merged_state_dict, save_adapter_dir

    if merge_lora:
        return save_hf_pretrained(merged_state_dict(state, lora), model_config=model_config, out=out)
    return save_adapter_dir(out, state, lora, base_model_path=model_config.path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Export an engine checkpoint as a Hugging Face model directory.")
    parser.add_argument("checkpoint", help="global_step_N directory written by the trainer")
    parser.add_argument("out", help="output directory (save_pretrained layout)")
    parser.add_argument("--model-path", default=None, help="the HF model directory the run started from")
    parser.add_argument(
        "--builtin-config",
        default=None,
        help="JSON of a built-in ModelConfig (to_dict()): export a built-in model as Llama",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a non-empty OUT (only once the new export is complete)"
    )
    parser.add_argument(
        "--allow-incomplete",
        action="store_true",
        help="export a checkpoint without checkpoint_complete.json (e.g. written by TrainEngine directly), unverified",
    )
    parser.add_argument(
        "--merge-lora",
        action="store_true",
        help="a LoRA run's checkpoint: write the merged model (plain HF directory) instead of the peft adapter",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        out = export_checkpoint(
            args.checkpoint,
            args.out,
            model_path=args.model_path,
            builtin_config=args.builtin_config,
            overwrite=args.overwrite,
            allow_incomplete=args.allow_incomplete,
            merge_lora=args.merge_lora,
        )
    except (ExportError, safe_load.UnsafeCheckpointError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    print(out)


if __name__ == "__main__":
    main()
