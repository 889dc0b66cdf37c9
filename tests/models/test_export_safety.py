"""Export safety (``python -m verl_balance.export``): a non-empty OUT needs --overwrite, which
replaces OUT whole (no stale tokenizer beside the new weights); only complete, checksum-intact
checkpoints are read; a failed export leaves nothing half-written; errors name the file.

The checkpoint is a tiny built-in model saved as DCP in this process, sealed like the trainer
seals it (``write_complete_record``). References: the tensors of the saved model; the file set of
an export into a fresh directory.
"""

from __future__ import annotations

import glob
import json
import os
import warnings

import pytest
import torch

from verl_balance import export
from verl_balance.export import ExportError, export_checkpoint
from verl_balance.export import main as export_main
from verl_balance.models import LlamaForCausalLM, ModelConfig
from verl_balance.trainer.checkpoint import write_complete_record


@pytest.fixture
def sealed_checkpoint(tmp_path):
    """(path, model) of a complete built-in checkpoint ``tmp_path/run/global_step_1``."""
    import torch.distributed.checkpoint as dcp

    config = ModelConfig.preset("tiny")
    torch.manual_seed(3)
    model = LlamaForCausalLM(config)
    ckpt = tmp_path / "run" / "global_step_1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
    state = {"global_step": 1, "model_config": {"kind": "builtin", **config.to_dict()}}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    write_complete_record(str(ckpt), {"step": 1})
    return str(ckpt), model


def _shard(ckpt: str) -> str:
    (shard,) = glob.glob(os.path.join(ckpt, "*.distcp"))
    return shard


def _stale_out(path) -> None:
    """An existing HF directory of another model: weights, config and its own tokenizer."""
    path.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (path / name).write_text("old " + name)


def _leftovers(parent) -> list[str]:
    return [n for n in os.listdir(parent) if ".staging-" in n or ".old-" in n]


def test_export_into_a_non_empty_directory_is_refused_naming_out_and_overwrite(sealed_checkpoint, tmp_path, capsys):
    ckpt, _ = sealed_checkpoint
    out = tmp_path / "hf"
    _stale_out(out)
    with pytest.raises(SystemExit) as exit_info:
        export_main([ckpt, str(out)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert str(out) in err and "--overwrite" in err
    assert (out / "config.json").read_text() == "old config.json", "the refused export touched OUT"
    assert _leftovers(tmp_path) == []


def test_overwrite_replaces_out_whole_leaving_no_stale_tokenizer(sealed_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt, model = sealed_checkpoint
    fresh = export_checkpoint(ckpt, str(tmp_path / "fresh"))
    out = tmp_path / "hf"
    _stale_out(out)
    export_main([ckpt, str(out) + os.sep, "--overwrite"])  # a trailing slash names the same OUT
    assert sorted(os.listdir(out)) == sorted(os.listdir(fresh)), "OUT holds exactly a fresh export's files"
    assert not (out / "tokenizer.json").exists()
    hf = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    torch.testing.assert_close(hf.model.layers[1].mlp.up_proj.weight, model.layers[1].mlp.up_proj.weight)
    assert _leftovers(tmp_path) == []


def test_a_failed_export_leaves_the_old_out_untouched_and_nothing_half_written(
    sealed_checkpoint, tmp_path, monkeypatch
):
    ckpt, _ = sealed_checkpoint

    def write_half_then_fail(state_dict, *, model_config, out, tokenizer_path=None):
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write("half")
        raise OSError("disk full while writing model.safetensors")

    monkeypatch.setattr(export, "save_builtin_as_hf_llama", write_half_then_fail)
    out = tmp_path / "hf"
    _stale_out(out)
    with pytest.raises(OSError, match="disk full"):
        export_checkpoint(ckpt, str(out), overwrite=True)
    assert (out / "config.json").read_text() == "old config.json"
    with pytest.raises(OSError, match="disk full"):
        export_checkpoint(ckpt, str(tmp_path / "new"))
    assert not (tmp_path / "new").exists()
    assert _leftovers(tmp_path) == []


def test_a_checkpoint_without_its_completeness_record_is_refused_naming_it(sealed_checkpoint, tmp_path):
    ckpt, _ = sealed_checkpoint
    os.remove(os.path.join(ckpt, "checkpoint_complete.json"))
    with pytest.raises(ExportError, match=r"global_step_1/checkpoint_complete.json is missing.*--allow-incomplete"):
        export_checkpoint(ckpt, str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()
    export_checkpoint(ckpt, str(tmp_path / "hf"), allow_incomplete=True)  # the explicit escape hatch works
    assert os.path.exists(tmp_path / "hf" / "model.safetensors")


def test_a_flipped_byte_in_a_shard_is_refused_naming_the_file(sealed_checkpoint, tmp_path):
    ckpt, _ = sealed_checkpoint
    shard = _shard(ckpt)
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        f.write(b"\xff" * 64)
    with pytest.raises(ExportError, match=rf"{os.path.basename(shard)} has xxh3_128 .*checksum mismatch"):
        export_checkpoint(ckpt, str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("sealed", [True, False], ids=["with_checksums", "allow_incomplete"])
def test_a_truncated_shard_is_named_not_a_bare_eoferror(sealed_checkpoint, tmp_path, sealed):
    ckpt, _ = sealed_checkpoint
    shard = _shard(ckpt)
    os.truncate(shard, os.path.getsize(shard) // 3)
    if not sealed:  # no manifest: the shard's length is checked against the DCP metadata instead
        os.remove(os.path.join(ckpt, "checkpoint_complete.json"))
    with pytest.raises(ExportError, match=rf"{os.path.basename(shard)} has \d+ bytes"):
        export_checkpoint(ckpt, str(tmp_path / "hf"), allow_incomplete=not sealed)
    assert not (tmp_path / "hf").exists()


def test_out_inside_the_checkpoint_is_refused(sealed_checkpoint):
    ckpt, _ = sealed_checkpoint
    with pytest.raises(ExportError, match="overlaps the checkpoint"):
        export_checkpoint(ckpt, os.path.join(ckpt, "hf"))
