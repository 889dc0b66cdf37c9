"""A received checkpoint reads only its own files (issue 50): a DCP ``.metadata`` naming another
checkpoint's shard (``..``, an absolute path), a shard that is a symbolic or hard link to one, a
``.metadata`` reading a file its manifest does not list, and an empty or malformed manifest are
refused by every loader (verification, the safe DCP reader, resume, export, the verl backend).

Each attack is real: the negative control loads the planted checkpoint with plain torch DCP
(``dcp.FileSystemReader``) and gets the *other* checkpoint's weights exactly. The attacker also
recomputes the checksum manifest, so checksums alone pass. No Ray.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from verl_balance.export import ExportError, export_checkpoint
from verl_balance.models import LlamaForCausalLM, ModelConfig
from verl_balance.trainer.checkpoint import (
    COMPLETE_FILE,
    CheckpointCorruptError,
    start_run,
    verify_checkpoint,
    write_complete_record,
)
from verl_balance.utils import checksums, safe_load
from verl_balance.utils.confined import CheckpointPathError, check_confined

CONFIG = {"trainer": {"seed": 1}}
SHARD = "__0_0.distcp"


def _save(path, seed: int) -> dict:
    """A sealed built-in checkpoint at ``path`` (model of ``seed``); returns its model state."""
    config = ModelConfig.preset("tiny")
    torch.manual_seed(seed)
    model_state = LlamaForCausalLM(config).state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model_state}, checkpoint_id=str(path), no_dist=True)
    torch.save({"step": 1, "global_step": 1, "scheduler": {}, "extra": {}}, path / "engine_state.pt")
    state = {"global_step": 1, "loader": {}, "model_config": {"kind": "builtin", **config.to_dict()}}
    (path / "trainer_state.json").write_text(json.dumps(state))
    write_complete_record(str(path), {"step": 1})
    return model_state


@pytest.fixture
def two(tmp_path):
    """(victim checkpoint, its weights, other run's checkpoint, its weights)."""
    other = tmp_path / "base" / "global_step_1"
    victim = tmp_path / "run" / "global_step_1"
    return str(victim), _save(victim, seed=1), str(other), _save(other, seed=2)


def _reseal(ckpt: str) -> None:
    with open(os.path.join(ckpt, COMPLETE_FILE), encoding="utf-8") as f:
        record = json.load(f)
    os.remove(os.path.join(ckpt, COMPLETE_FILE))
    write_complete_record(ckpt, {k: v for k, v in record.items() if k not in ("files", "hash")})


def _point_metadata_at(ckpt: str, target: str) -> None:
    """Rewrite ``.metadata`` (allowed types only) so every storage item reads ``target``; delete the
    own shard and reseal the manifest, as the probe did."""
    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        metadata = pickle.load(f)  # our own, just written: trusted here
    metadata.storage_data = {k: dataclasses.replace(v, relative_path=target) for k, v in metadata.storage_data.items()}
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    os.remove(os.path.join(ckpt, SHARD))
    _reseal(ckpt)


def _plain_torch_load(ckpt: str, like: dict) -> dict:
    state = {"model": {k: torch.zeros_like(v) for k, v in like.items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=dcp.FileSystemReader(ckpt), no_dist=True)
    return state["model"]


def _assert_every_loader_refuses(ckpt: str, tmp_path, like: dict, match: str) -> None:
    with pytest.raises(CheckpointCorruptError, match=match):
        verify_checkpoint(ckpt)
    with pytest.raises(CheckpointCorruptError, match=match):
        start_run(str(tmp_path / "new"), resume_mode="resume_path", resume_from_path=ckpt, config=CONFIG)
    with pytest.raises(ExportError, match=match):
        export_checkpoint(ckpt, str(tmp_path / "hf"))
    assert not os.path.exists(tmp_path / "hf")
    with pytest.raises(CheckpointPathError, match=match):  # the reader itself, also without a manifest
        safe_load.dcp_load({"model": {k: torch.zeros_like(v) for k, v in like.items()}}, ckpt, no_dist=True)
    with pytest.raises(CheckpointPathError, match=match):
        checksums.dcp_truncated_files(ckpt)  # the unverified path (allow_unverified) reads the metadata too
    pytest.importorskip("verl")
    from verl_balance.integrations.verl.backend import sealed_checkpoint

    assert "refused" in (sealed_checkpoint._problem(ckpt) or "")


def _assert_plain_torch_reads_the_other(ckpt: str, other_state: dict, victim_state: dict) -> None:
    """Negative control: torch's own reader follows the path/link to the other run's weights."""
    loaded = _plain_torch_load(ckpt, victim_state)
    for name, tensor in other_state.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)
    assert not torch.equal(loaded["embed_tokens.weight"], victim_state["embed_tokens.weight"])


@pytest.mark.parametrize("kind", ["dotdot", "absolute"])
def test_metadata_naming_a_file_outside_the_checkpoint_is_refused(two, tmp_path, kind):
    victim, victim_state, other, other_state = two
    target = "../../base/global_step_1/" + SHARD if kind == "dotdot" else os.path.join(other, SHARD)
    _point_metadata_at(victim, target)
    with open(os.path.join(victim, COMPLETE_FILE), encoding="utf-8") as f:
        assert checksums.manifest_shape_problems(json.load(f)["files"]) == []  # a well-formed, resealed manifest
    why = "'..' component" if kind == "dotdot" else "absolute path"
    _assert_plain_torch_reads_the_other(victim, other_state, victim_state)
    _assert_every_loader_refuses(victim, tmp_path, victim_state, match=rf"{SHARD}.*{why}")


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_shard_linked_to_another_checkpoints_shard_is_refused(two, tmp_path, link):
    victim, victim_state, other, other_state = two
    os.remove(os.path.join(victim, SHARD))
    (os.symlink if link == "symlink" else os.link)(os.path.join(other, SHARD), os.path.join(victim, SHARD))
    # the shards have equal sizes (same architecture), so only the link gives it away
    _reseal(victim)
    why = "symbolic link" if link == "symlink" else "2 hard links but only 1 inside"
    _assert_plain_torch_reads_the_other(victim, other_state, victim_state)
    _assert_every_loader_refuses(victim, tmp_path, victim_state, match=why)


def test_hard_links_inside_the_checkpoint_only_are_accepted(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "a").write_bytes(b"x")
    os.link(root / "a", root / "b")
    check_confined(str(root), ["a", "b"])  # both names are inside: nothing outside shares the file
    os.link(root / "a", tmp_path / "outside")
    with pytest.raises(CheckpointPathError, match="3 hard links but only 2 inside"):
        check_confined(str(root), ["a"])


def test_a_linked_directory_inside_the_checkpoint_is_refused_and_the_checkpoint_may_be_reached_by_a_link(two, tmp_path):
    victim, victim_state, other, _ = two
    os.symlink(victim, tmp_path / "alias")
    verify_checkpoint(str(tmp_path / "alias"))  # the checkpoint directory itself may be a link
    os.makedirs(os.path.join(victim, "sub"))
    os.symlink(os.path.dirname(other), os.path.join(victim, "sub", "d"))
    with pytest.raises(CheckpointPathError, match="symbolic link"):
        check_confined(victim, ["sub/d/global_step_1/" + SHARD])


def test_a_metadata_reading_a_file_the_manifest_does_not_list_is_refused(two, tmp_path):
    victim, victim_state, _, _ = two
    record_path = os.path.join(victim, COMPLETE_FILE)
    with open(record_path, encoding="utf-8") as f:
        record = json.load(f)
    del record["files"][SHARD]
    with open(record_path, "w", encoding="utf-8") as f:
        json.dump(record, f)
    with pytest.raises(CheckpointCorruptError, match=rf"reads \['{SHARD}'\], which the manifest does not list"):
        verify_checkpoint(victim)
    record["files"][SHARD] = {"size": os.path.getsize(os.path.join(victim, SHARD)), "xxh3_128": "0"}
    with open(record_path, "w", encoding="utf-8") as f:  # negative control: listed, so it is checked (and differs)
        json.dump(record, f)
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        verify_checkpoint(victim)


@pytest.mark.parametrize(
    ("files", "why"),
    [({}, "is empty"), ([], "is a list"), ({SHARD: 3}, "is not"), ({SHARD: {"size": "1", "xxh3_128": "0"}}, "is not")],
    ids=["empty", "list", "entry_int", "size_str"],
)
def test_an_empty_or_malformed_manifest_is_refused_by_every_verifier(two, tmp_path, files, why):
    victim, _, _, _ = two
    shard = os.path.join(victim, SHARD)
    with open(shard, "r+b") as f:  # 64 flipped bytes: only the checksums can see them
        f.seek(os.path.getsize(shard) // 2)
        data = f.read(64)
        f.seek(-64, os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in data))
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):  # negative control: the real manifest
        verify_checkpoint(victim)
    record_path = os.path.join(victim, COMPLETE_FILE)
    with open(record_path, encoding="utf-8") as f:
        record = json.load(f)
    record["files"] = files
    with open(record_path, "w", encoding="utf-8") as f:
        json.dump(record, f)
    with pytest.raises(CheckpointCorruptError, match=rf"manifest.*{why}"):
        verify_checkpoint(victim)
    with pytest.raises(ExportError, match=rf"manifest.*{why}"):
        export_checkpoint(victim, str(tmp_path / "hf"))
    with pytest.raises(CheckpointCorruptError, match=rf"manifest.*{why}"):
        start_run(str(tmp_path / "new"), resume_mode="resume_path", resume_from_path=victim, config=CONFIG)
    pytest.importorskip("verl")
    from verl_balance.integrations.verl.backend import sealed_checkpoint

    assert why in sealed_checkpoint._problem(victim)


def test_a_linked_metadata_file_is_refused_also_without_a_manifest(two, tmp_path):
    victim, victim_state, other, other_state = two
    os.remove(os.path.join(victim, ".metadata"))
    os.symlink(os.path.join(other, ".metadata"), os.path.join(victim, ".metadata"))
    with pytest.raises(CheckpointPathError, match=r"'.metadata'.*symbolic link"):
        safe_load.read_dcp_metadata(victim)  # the reader itself: the unverified opt-in reads it too
    with pytest.raises(CheckpointPathError, match="symbolic link"):
        checksums.dcp_truncated_files(victim)
    loaded = _plain_torch_load(victim, victim_state)  # negative control: torch follows it (the other's shard name)
    assert set(loaded) == set(victim_state)


def test_a_linked_completeness_record_counts_as_none(two, tmp_path):
    from verl_balance.trainer.checkpoint import CheckpointUnverifiedError

    victim, _, other, _ = two
    os.remove(os.path.join(victim, COMPLETE_FILE))
    os.symlink(os.path.join(other, COMPLETE_FILE), os.path.join(victim, COMPLETE_FILE))
    with pytest.raises(CheckpointUnverifiedError, match="no readable checkpoint_complete.json"):
        verify_checkpoint(victim)
    pytest.importorskip("verl")
    from verl_balance.integrations.verl.backend import sealed_checkpoint

    assert "has no verified" in (sealed_checkpoint._problem(victim) or "")
    with open(os.path.join(victim, COMPLETE_FILE), encoding="utf-8") as f:  # negative control: a plain read
        assert json.load(f)["files"]  # follows it to the other checkpoint's manifest
