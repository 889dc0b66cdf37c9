"""A trained LoRA engine (dp=2, FSDP2-sharded) exported three ways gives the engine's log-probs:
the peft adapter directory of ``python -m verl_balance.export`` loaded with ``PeftModel.from_pretrained``
(peft's own forward: an independent reference), the ``--merge-lora`` plain HF directory, and the
engine's streamed ``save_hf_model`` (merged)."""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch

from verl_balance.distributed import ParallelLayout
from verl_balance.distributed.launcher import run_on_ranks
from verl_balance.engine import EngineConfig, TrainEngine
from verl_balance.engine.config import OptimConfig
from verl_balance.models.hf import HFModelConfig
from verl_balance.models.tiny_hf import write_tiny_model

pytestmark = pytest.mark.slow  # spawns a process group

LENGTHS = [9, 4, 12, 7]


def _batch(vocab_size: int) -> dict:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, min(vocab_size, 300), (len(LENGTHS), max(LENGTHS)), generator=gen)
    mask = (torch.arange(max(LENGTHS))[None] < torch.tensor(LENGTHS)[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "loss_mask": mask.float()}


def _train_and_save(rank, *, path, root):
    config = HFModelConfig.from_pretrained(path)
    engine_config = EngineConfig(
        seed=3, lora_rank=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], optim=OptimConfig(lr=5e-2)
    )
    engine = TrainEngine(
        model_config=config, engine_config=engine_config, layout=ParallelLayout(dp=2, sp=1, device_type="cpu")
    )
    batch = _batch(config.vocab_size)
    half = {k: v[2 * rank : 2 * rank + 2] for k, v in batch.items()}
    for _ in range(3):
        engine.train_batch([half])
    [out] = engine.compute_log_prob([batch])
    engine.save_checkpoint(os.path.join(root, "ckpt"), step=3)
    engine.save_hf_model(os.path.join(root, "engine_merged"))
    return out["log_probs"]


def _log_probs(model, batch) -> torch.Tensor:
    out = torch.zeros(batch["input_ids"].shape)
    with torch.no_grad():
        for i, n in enumerate(LENGTHS):
            ids = batch["input_ids"][i, :n]
            logits = model(input_ids=ids[None]).logits[0].float()
            out[i, 1:n] = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_export")
    path = write_tiny_model(str(root / "qwen2"), family="qwen2", initializer_range=0.02)
    log_probs = run_on_ranks(functools.partial(_train_and_save, path=path, root=str(root)), world=2)[0]
    return root, path, log_probs


def test_peft_adapter_export_gives_the_engines_log_probs(trained):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from verl_balance.export import main as export_main

    root, path, engine_log_probs = trained
    out = str(root / "adapter")
    export_main([str(root / "ckpt"), out, "--model-path", path, "--allow-incomplete"])
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = _batch(base.config.vocab_size)
    base_log_probs = _log_probs(base, batch)
    peft_model = PeftModel.from_pretrained(base, out)
    torch.testing.assert_close(_log_probs(peft_model, batch), engine_log_probs, rtol=1e-5, atol=1e-5)
    # Negative control: the base model alone is measurably different (the adapters trained).
    assert (base_log_probs - engine_log_probs).abs().max() > 1e-3


def test_merged_exports_equal_base_plus_adapter(trained):
    from transformers import AutoModelForCausalLM

    from verl_balance.export import main as export_main

    root, path, engine_log_probs = trained
    out = str(root / "merged")
    export_main([str(root / "ckpt"), out, "--model-path", path, "--allow-incomplete", "--merge-lora"])
    for directory in (out, str(root / "engine_merged")):
        merged = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        assert not any("lora" in n or "base_layer" in n for n, _ in merged.named_parameters())
        batch = _batch(merged.config.vocab_size)
        torch.testing.assert_close(_log_probs(merged, batch), engine_log_probs, rtol=1e-5, atol=1e-5)


def test_merge_lora_on_a_full_checkpoint_is_refused(trained, tmp_path):
    from verl_balance.export import ExportError, export_checkpoint

    root, path, _ = trained
    plain = tmp_path / "plain"
    os.makedirs(plain)
    for name in os.listdir(root / "ckpt"):
        if name != "adapter_config.json":
            os.symlink(root / "ckpt" / name, plain / name)
    with pytest.raises(ExportError, match="--merge-lora"):
        export_checkpoint(str(plain), str(tmp_path / "out"), model_path=path, allow_incomplete=True, merge_lora=True)


def _log_probs_from_adapter(rank, *, path, adapter):
    config = HFModelConfig.from_pretrained(path)
    engine_config = EngineConfig(seed=99, lora_rank=1, lora_adapter_path=adapter)
    engine = TrainEngine(
        model_config=config, engine_config=engine_config, layout=ParallelLayout(dp=2, sp=1, device_type="cpu")
    )
    trainable = sorted(n for n, p in engine.model.named_parameters() if p.requires_grad)
    [out] = engine.compute_log_prob([_batch(config.vocab_size)])
    return out["log_probs"], trainable


def test_lora_adapter_path_starts_from_the_exported_adapter(trained):
    from verl_balance.export import main as export_main

    root, path, engine_log_probs = trained
    out = str(root / "adapter_for_start")
    export_main([str(root / "ckpt"), out, "--model-path", path, "--allow-incomplete"])
    log_probs, trainable = run_on_ranks(functools.partial(_log_probs_from_adapter, path=path, adapter=out), world=2)[0]
    # The adapter's own rank and targets (q_proj, v_proj, down_proj), not lora_rank=1 / all-linear.
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "v_proj", "down_proj"}
    torch.testing.assert_close(log_probs, engine_log_probs, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- adapters-only checkpoints
def _copy_base(path: str, dst: str, *, corrupt: bool) -> str:
    """A copy of the model directory; with ``corrupt`` one weight of model.safetensors changed."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(path, dst)
    if corrupt:
        tensors = load_file(os.path.join(dst, "model.safetensors"))
        name = next(n for n in sorted(tensors) if n.endswith("q_proj.weight"))
        tensors[name] = tensors[name] + 1e-3
        save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_lora_checkpoint_holds_only_the_adapters_and_their_optimizer_state(trained):
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from verl_balance.engine.lora import BASE_FINGERPRINT_FILE, is_lora_name

    root, path, _ = trained
    ckpt = str(root / "ckpt")
    metadata = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    keys = list(metadata)
    model_keys = [k.split(".", 1)[1] for k in keys if k.startswith("model.")]
    optim_params = {".".join(k.split(".")[2:-1]) for k in keys if k.startswith("optim.state.")}
    assert model_keys and all(is_lora_name(k) for k in model_keys), model_keys
    assert optim_params == set(model_keys), sorted(optim_params ^ set(model_keys))[:5]
    layers = HFModelConfig.from_pretrained(path).num_layers
    assert len(model_keys) == layers * 3 * 2  # (q_proj, v_proj, down_proj) x (lora_A, lora_B) per layer
    with open(os.path.join(ckpt, BASE_FINGERPRINT_FILE)) as f:
        recorded = json.load(f)
    assert recorded["path"] == os.path.abspath(path) and "model.safetensors" in recorded["files"]
    # The tiny model's adapters are a fair share of it, yet the directory is smaller than the base alone.
    base_bytes = os.path.getsize(os.path.join(path, "model.safetensors"))
    ckpt_bytes = sum(os.path.getsize(os.path.join(ckpt, n)) for n in os.listdir(ckpt))
    assert ckpt_bytes < base_bytes, (ckpt_bytes, base_bytes)
    saved_numel = sum(metadata[k].size.numel() for k in keys if k.startswith("model."))
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert saved_numel < base.num_parameters() / 10, (saved_numel, base.num_parameters())


def _resume_on(rank, *, path, ckpt):
    config = HFModelConfig.from_pretrained(path)
    engine_config = EngineConfig(
        seed=7, lora_rank=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], optim=OptimConfig(lr=5e-2)
    )
    engine = TrainEngine(
        model_config=config, engine_config=engine_config, layout=ParallelLayout(dp=2, sp=1, device_type="cpu")
    )
    try:
        engine.load_checkpoint(ckpt)
    except ValueError as err:
        return type(err).__name__, str(err)
    [out] = engine.compute_log_prob([_batch(config.vocab_size)])
    return out["log_probs"], engine.global_step


def test_resume_from_adapters_on_a_copied_base_is_exact_and_a_changed_base_is_refused(trained, tmp_path):
    root, path, engine_log_probs = trained
    ckpt = str(root / "ckpt")
    same = _copy_base(path, str(tmp_path / "same"), corrupt=False)
    log_probs, step = run_on_ranks(functools.partial(_resume_on, path=same, ckpt=ckpt), world=2)[0]
    torch.testing.assert_close(log_probs, engine_log_probs, rtol=0, atol=0)
    changed = _copy_base(path, str(tmp_path / "changed"), corrupt=True)
    results = run_on_ranks(functools.partial(_resume_on, path=changed, ckpt=ckpt), world=2)
    for kind, message in results:  # every rank refuses (none is left waiting in a collective)
        assert kind == "BaseMismatchError"
        assert os.path.join(changed, "model.safetensors") in message and os.path.abspath(path) in message


def test_export_with_a_changed_base_is_refused_naming_the_file(trained, tmp_path):
    from verl_balance.export import ExportError, export_checkpoint

    root, path, _ = trained
    changed = _copy_base(path, str(tmp_path / "changed"), corrupt=True)
    for merge in (False, True):
        with pytest.raises(ExportError, match="model.safetensors changed"):
            export_checkpoint(
                str(root / "ckpt"),
                str(tmp_path / f"out{merge}"),
                model_path=changed,
                allow_incomplete=True,
                merge_lora=merge,
            )


def test_merged_export_from_the_recorded_base_equals_peft_merge_and_unload(trained, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from verl_balance.export import export_checkpoint

    root, path, _ = trained
    adapter, merged = str(tmp_path / "adapter"), str(tmp_path / "merged")
    export_checkpoint(str(root / "ckpt"), adapter, model_path=path, allow_incomplete=True)
    export_checkpoint(str(root / "ckpt"), merged, allow_incomplete=True, merge_lora=True)  # base from the record
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference = PeftModel.from_pretrained(base, adapter).merge_and_unload().state_dict()
    ours = load_file(os.path.join(merged, "model.safetensors"))
    assert set(ours) <= set(reference)
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-6, atol=1e-6, msg=name)
    base_q = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    assert any((ours[n] - base_q[n]).abs().max() > 1e-4 for n in ours)  # the adapters are merged in
