"""A checkpoint received from elsewhere never runs code, a checkpoint without its verified
completeness record is refused by every loader (unless opted in), and a warm start from another
architecture is refused naming the keys. No Ray: the loaders' shared readers, export, the
trainer's start-up and the verl backend's seal are called in this process.

The planted payloads are real: each negative control shows the plain reader (``pickle.load``,
``torch.load(weights_only=False)``, ``dcp.load``) creating the marker directory, and each refusal
leaves it absent. The attacker also rewrites the checksum manifest, so verification passes.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from verl_balance.export import ExportError, export_checkpoint
from verl_balance.export import main as export_main
from verl_balance.models import LlamaForCausalLM, ModelConfig
from verl_balance.trainer.checkpoint import (
    COMPLETE_FILE,
    CheckpointUnverifiedError,
    start_run,
    verify_checkpoint,
    write_complete_record,
)
from verl_balance.utils import checksums, safe_load
from verl_balance.utils.safe_load import UnsafeCheckpointError

CONFIG = {"trainer": {"seed": 1}}


class Payload:
    """Unpickling it creates the directory ``marker`` (what planted code would do, harmlessly)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _quiet_dcp_save(state: dict, path: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path, no_dist=True)


@pytest.fixture
def sealed(tmp_path):
    """A complete built-in checkpoint ``run/global_step_1`` (model, optimizer values, engine state)."""
    config = ModelConfig.preset("tiny")
    torch.manual_seed(3)
    model = LlamaForCausalLM(config)
    ckpt = tmp_path / "run" / "global_step_1"
    _quiet_dcp_save(
        {"model": model.state_dict(), "optim": {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99)}]}}, str(ckpt)
    )
    torch.save({"step": 1, "global_step": 1, "scheduler": {"last_epoch": 1}, "extra": {}}, ckpt / "engine_state.pt")
    state = {"global_step": 1, "loader": {}, "model_config": {"kind": "builtin", **config.to_dict()}}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    write_complete_record(str(ckpt), {"step": 1})
    return str(ckpt), model


def plant_metadata(ckpt: str, marker: str) -> None:
    """Rewrite ``.metadata`` with the payload inside the real metadata, then reseal the manifest."""
    metadata = safe_load.read_dcp_metadata(ckpt)
    metadata.planner_data = {"planted": Payload(marker)}
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    _reseal(ckpt)


def plant_engine_state(ckpt: str, marker: str) -> None:
    path = os.path.join(ckpt, "engine_state.pt")
    state = safe_load.load_torch_file(path)
    torch.save({**state, "extra": {"planted": Payload(marker)}}, path)
    _reseal(ckpt)


def _reseal(ckpt: str) -> None:
    with open(os.path.join(ckpt, COMPLETE_FILE), encoding="utf-8") as f:
        record = json.load(f)
    write_complete_record(ckpt, {k: v for k, v in record.items() if k not in ("files", "hash")})


# ---------------------------------------------------------------------- planted payloads
def test_planted_dcp_metadata_is_refused_naming_the_file_and_never_runs(sealed, tmp_path):
    ckpt, _ = sealed
    marker = str(tmp_path / "ran")
    plant_metadata(ckpt, marker)
    verify_checkpoint(ckpt)  # the attacker resealed the manifest: checksums alone cannot catch it
    metadata_file = os.path.join(ckpt, ".metadata")
    for read in (
        lambda: safe_load.read_dcp_metadata(ckpt),
        lambda: safe_load.dcp_load({"model": {}}, ckpt, no_dist=True),
        lambda: checksums.dcp_truncated_files(ckpt),
    ):
        with pytest.raises(UnsafeCheckpointError, match=rf"{metadata_file} is refused.*posix.mkdir"):
            read()
    assert not os.path.exists(marker)
    with open(metadata_file, "rb") as f:  # negative control: torch's reader (pickle.load) runs it
        pickle.load(f)
    assert os.path.isdir(marker)


def test_planted_engine_state_is_refused_naming_the_file_and_never_runs(sealed, tmp_path):
    ckpt, _ = sealed
    marker = str(tmp_path / "ran")
    plant_engine_state(ckpt, marker)
    path = os.path.join(ckpt, "engine_state.pt")
    with pytest.raises(UnsafeCheckpointError, match=rf"{path} is refused"):
        safe_load.load_torch_file(path)
    assert not os.path.exists(marker)
    torch.load(path, weights_only=False)  # negative control: the old reader runs it
    assert os.path.isdir(marker)


def test_a_planted_non_tensor_value_in_a_dcp_shard_is_refused_and_never_runs(tmp_path):
    ckpt, marker = str(tmp_path / "ckpt"), str(tmp_path / "ran")
    _quiet_dcp_save({"model": {"w": torch.ones(2)}, "extra": Payload(marker)}, ckpt)
    assert not os.path.exists(marker)
    with pytest.raises(UnsafeCheckpointError, match=r"'extra' of checkpoint .*ckpt is refused"):
        safe_load.dcp_load({"model": {"w": torch.zeros(2)}, "extra": None}, ckpt, no_dist=True)
    assert not os.path.exists(marker)
    with warnings.catch_warnings():  # negative control: torch's default planner runs it
        warnings.simplefilter("ignore")
        dcp.load({"model": {"w": torch.zeros(2)}, "extra": None}, checkpoint_id=ckpt, no_dist=True)
    assert os.path.isdir(marker)


def test_the_safe_readers_load_a_genuine_checkpoint_exactly(sealed):
    ckpt, model = sealed
    state = {
        "model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()},
        "optim": {"param_groups": [{"lr": 0.0, "betas": None}]},
    }
    safe_load.dcp_load(state, ckpt, no_dist=True)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(state["model"][name], tensor, rtol=0, atol=0)
    assert state["optim"]["param_groups"][0] == {"lr": 1e-3, "betas": (0.9, 0.99)}
    assert safe_load.load_torch_file(os.path.join(ckpt, "engine_state.pt"))["global_step"] == 1


def test_export_refuses_a_planted_payload_naming_the_file_and_it_never_runs(sealed, tmp_path, capsys):
    ckpt, _ = sealed
    marker = str(tmp_path / "ran")
    plant_metadata(ckpt, marker)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata is refused"):
        export_checkpoint(ckpt, str(tmp_path / "hf"))
    with pytest.raises(SystemExit) as exit_info:
        export_main([ckpt, str(tmp_path / "hf2")])
    assert exit_info.value.code == 2 and ".metadata is refused" in capsys.readouterr().err
    assert not os.path.exists(marker) and not os.path.exists(tmp_path / "hf")


# ---------------------------------------------------------------------- completeness
def _unseal(ckpt: str, *, keep_record_without_checksums: bool) -> None:
    record_path = os.path.join(ckpt, COMPLETE_FILE)
    if keep_record_without_checksums:
        with open(record_path, encoding="utf-8") as f:
            record = json.load(f)
        del record["files"], record["hash"]
        with open(record_path, "w", encoding="utf-8") as f:
            json.dump(record, f)
    else:
        os.remove(record_path)


@pytest.mark.parametrize("old_record", [False, True], ids=["no_record", "record_without_checksums"])
def test_a_checkpoint_without_a_verified_record_is_refused_by_every_loader_unless_opted_in(
    sealed, tmp_path, old_record
):
    ckpt, _ = sealed
    _unseal(ckpt, keep_record_without_checksums=old_record)
    with pytest.raises(CheckpointUnverifiedError, match=rf"{ckpt}.*trainer.allow_unverified_checkpoint=true"):
        verify_checkpoint(ckpt)
    with pytest.raises(CheckpointUnverifiedError, match=r"trainer.resume_from_path=.*allow_unverified_checkpoint"):
        start_run(str(tmp_path / "new"), resume_mode="resume_path", resume_from_path=ckpt, config=CONFIG)
    with pytest.raises(ExportError, match=r"--allow-incomplete"):
        export_checkpoint(ckpt, str(tmp_path / "hf"))
    # the explicit opt-ins for old checkpoints
    _, loaded = start_run(
        str(tmp_path / "new"), resume_mode="resume_path", resume_from_path=ckpt, config=CONFIG, allow_unverified=True
    )
    assert loaded == ckpt
    export_checkpoint(ckpt, str(tmp_path / "hf"), allow_incomplete=True)


def test_the_verl_backend_refuses_an_unsealed_checkpoint_and_accepts_a_sealed_one(sealed, monkeypatch):
    pytest.importorskip("verl")
    from verl_balance.integrations.verl.backend import sealed_checkpoint

    ckpt, _ = sealed
    monkeypatch.delenv(sealed_checkpoint.ALLOW_UNVERIFIED_ENV, raising=False)
    assert sealed_checkpoint._problem(ckpt) is None
    with open(os.path.join(ckpt, "engine_state.pt"), "ab") as f:
        f.write(b"x")
    assert "engine_state.pt" in sealed_checkpoint._problem(ckpt)
    os.remove(os.path.join(ckpt, COMPLETE_FILE))
    assert sealed_checkpoint.ALLOW_UNVERIFIED_ENV in sealed_checkpoint._problem(ckpt)
    monkeypatch.setenv(sealed_checkpoint.ALLOW_UNVERIFIED_ENV, "1")
    assert sealed_checkpoint._problem(ckpt) is None


# ---------------------------------------------------------------------- warm-start compatibility
def test_a_two_layer_checkpoint_does_not_fit_a_one_layer_model_and_the_keys_are_named(sealed):
    ckpt, _ = sealed
    metadata = safe_load.read_dcp_metadata(ckpt)
    two = ModelConfig.preset("tiny")
    assert two.num_layers == 2
    one = LlamaForCausalLM(replace(ModelConfig.preset("tiny"), num_layers=1)).state_dict()
    problems = " ".join(safe_load.state_mismatch(metadata, one))
    assert "unexpected" in problems and "layers.1.attn.q_proj.weight" in problems and "missing" not in problems
    wider = LlamaForCausalLM(
        replace(two, hidden_size=2 * two.hidden_size, intermediate_size=2 * two.intermediate_size)
    ).state_dict()
    assert "shape mismatch" in " ".join(safe_load.state_mismatch(metadata, wider))
    same = LlamaForCausalLM(two).state_dict()  # negative control: the same architecture fits exactly
    assert safe_load.state_mismatch(metadata, same) == []
