"""Export: an engine checkpoint of an HF model -> save_pretrained dir that reloads the same logits."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from safetensors import safe_open

from verl_balance.distributed import ParallelLayout
from verl_balance.distributed.launcher import run_on_ranks
from verl_balance.engine import EngineConfig, TrainEngine
from verl_balance.engine.config import OptimConfig
from verl_balance.export import ExportError, export_checkpoint, save_hf_pretrained
from verl_balance.export import main as export_main
from verl_balance.models.hf import HFModelConfig, build_hf_model
from verl_balance.trainer.checkpoint import write_complete_record


def _micro_batches(vocab_size: int, rank: int):
    gen = torch.Generator().manual_seed(10 + rank)
    lengths = [7, 3, 11]
    ids = torch.randint(0, vocab_size, (len(lengths), max(lengths)), generator=gen)
    mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
    return [{"input_ids": ids * mask, "attention_mask": mask, "loss_mask": mask.float()}]


def _train_and_save(rank, *, path: str, ckpt: str):
    config = HFModelConfig.from_pretrained(path)
    engine = TrainEngine(
        model_config=config,
        layout=ParallelLayout(dp=2, sp=1, device_type="cpu"),
        engine_config=EngineConfig(optim=OptimConfig(lr=1e-2), total_steps=2),
    )
    before = engine.full_state_dict()
    for _ in range(2):
        engine.train_batch(_micro_batches(config.vocab_size, rank))
    engine.save_checkpoint(ckpt, step=2)
    return before, engine.full_state_dict()


def _probe_logits(model, vocab_size: int):
    ids = torch.randint(0, vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["llama_kv1_tied", "qwen2_untied_window"])
def test_exported_checkpoint_reloads_with_identical_logits(tiny_model_dirs, tmp_path, variant):
    from transformers import AutoModelForCausalLM

    path, ckpt, out = tiny_model_dirs[variant], str(tmp_path / "global_step_2"), str(tmp_path / "hf")
    before, trained = run_on_ranks(functools.partial(_train_and_save, path=path, ckpt=ckpt), world=2)[0]
    assert any(not torch.equal(before[k], trained[k]) for k in trained)  # training moved the weights
    write_complete_record(ckpt, {"step": 2})  # what the trainer adds: the record with checksums
    export_main([ckpt, out, "--model-path", path])

    config = HFModelConfig.from_pretrained(path)
    reference = build_hf_model(config, attn_implementation="sdpa")
    reference.load_state_dict(trained)
    reloaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, attn_implementation="sdpa")
    assert torch.equal(_probe_logits(reloaded, config.vocab_size), _probe_logits(reference, config.vocab_size))
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert ("lm_head.weight" in keys) == (not config.tie_word_embeddings)  # no duplicate tied head
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
    if config.tie_word_embeddings:
        assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight


def test_gathered_tied_weights_are_written_once(tiny_model_dirs, tmp_path):
    """A gathered full state dict holds lm_head and embed_tokens as separate copies (the trap);
    the export copies into one tied Parameter, so the file has no lm_head."""
    config = HFModelConfig.from_pretrained(tiny_model_dirs["llama_kv1_tied"])
    state = {k: v.clone() for k, v in build_hf_model(config).state_dict().items()}
    assert state["lm_head.weight"].data_ptr() != state["model.embed_tokens.weight"].data_ptr()
    out = save_hf_pretrained(state, model_config=config, out=str(tmp_path / "hf"))
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    # save_hf_directory (also trainer.save_hf_model's global_step_N/hf): files 0666 less the umask, not 0600
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(os.path.join(out, "model.safetensors")).st_mode & 0o777 == 0o666 & ~umask
    assert os.path.isfile(os.path.join(out, "generation_config.json"))


def test_export_errors_name_what_is_missing(tiny_model_dirs, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with pytest.raises(ExportError, match="global_step_N"):
        export_checkpoint(str(ckpt), str(tmp_path / "out"), model_path=tiny_model_dirs["llama"])
    (ckpt / ".metadata").write_bytes(b"")
    with pytest.raises(ExportError, match="--model-path"):
        export_checkpoint(str(ckpt), str(tmp_path / "out"), allow_incomplete=True)
    config = HFModelConfig.from_pretrained(tiny_model_dirs["llama"])
    with pytest.raises(ExportError, match="missing"):
        save_hf_pretrained(
            {"model.norm.weight": torch.ones(config.hidden_size)}, model_config=config, out=str(tmp_path / "bad")
        )


@pytest.mark.parametrize("tie", [False, True])
def test_builtin_model_exports_as_hf_llama_with_the_same_logits(tmp_path, tie):
    """Independent check of the built-in model's HF-Llama semantics, and its export path."""
    from transformers import AutoModelForCausalLM

    from verl_balance.export import save_builtin_as_hf_llama
    from verl_balance.models import LlamaForCausalLM, ModelConfig

    config = ModelConfig(**{**ModelConfig.preset("tiny").to_dict(), "tie_word_embeddings": tie, "rope_theta": 500.0})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    out = save_builtin_as_hf_llama(model.state_dict(), model_config=config, out=str(tmp_path / "hf"))
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, attn_implementation="sdpa")
    ids = torch.randint(0, config.vocab_size, (13,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(input_ids=ids, position_ids=torch.arange(13), cu_seqlens=torch.tensor([0, 13]), max_seqlen=13)
        theirs = hf(input_ids=ids[None], use_cache=False).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_builtin_checkpoint_cli_export_reads_dcp(tmp_path):
    import json
    import warnings

    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM, GenerationConfig

    from verl_balance.models import LlamaForCausalLM, ModelConfig

    config = ModelConfig.preset("tiny")
    torch.manual_seed(2)
    model = LlamaForCausalLM(config)
    ckpt = str(tmp_path / "global_step_1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict()}, checkpoint_id=ckpt, no_dist=True)
    (tmp_path / "model_config.json").write_text(json.dumps(config.to_dict()))
    export_main(
        [ckpt, str(tmp_path / "hf"), "--builtin-config", str(tmp_path / "model_config.json"), "--allow-incomplete"]
    )
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    torch.testing.assert_close(hf.model.layers[1].self_attn.k_proj.weight, model.layers[1].attn.k_proj.weight)
    # Readable by a serving process of another user, as save_pretrained's files are (safetensors writes 0600).
    umask = os.umask(0)
    os.umask(umask)
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        assert os.stat(tmp_path / "hf" / name).st_mode & 0o777 == 0o666 & ~umask, name
    generation = GenerationConfig.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    assert generation.to_dict() == GenerationConfig.from_model_config(hf.config).to_dict()
