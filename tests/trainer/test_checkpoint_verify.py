"""Verified checkpoints without Ray: the completeness record's manifest (size + xxh3_128 of every
file), its check before a resume, and the fallback past a corrupt checkpoint.

The workers are replaced by a fake group that writes a few files per save (a shard, a nested
``hf/`` file). References: checksums computed independently with ``xxhash`` on the files' bytes,
hand-worked choices of which checkpoint a resume must pick.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import xxhash

from verl_balance.trainer import checkpoint
from verl_balance.trainer.checkpoint import (
    COMPLETE_FILE,
    CheckpointCorruptError,
    save_trainer_checkpoint,
    start_run,
    verify_checkpoint,
)
from verl_balance.utils import checksums
from verl_balance.utils.tracking import Tracking, read_metrics

CONFIG = {"model": {"name": "tiny"}, "trainer": {"seed": 1}}


class ShardGroup:
    """A save writes ``shard_0.bin`` and ``shard_1.bin`` (bytes depending on the step) and
    ``hf/config.json``; no ``hash_checkpoint_files``, so the driver hashes."""

    def save_checkpoint(self, path: str, step: int) -> None:
        os.makedirs(os.path.join(path, "hf"), exist_ok=True)
        for rank in range(2):
            with open(os.path.join(path, f"shard_{rank}.bin"), "wb") as f:
                f.write(bytes((step * 7 + rank + i) % 256 for i in range(4096 * (rank + 1))))
        with open(os.path.join(path, "hf", "config.json"), "w") as f:
            json.dump({"step": step}, f)


class RankedShardGroup(ShardGroup):
    """Also hashes like the worker group: each of ``ranks`` hashes its share, one dict per rank."""

    def __init__(self, ranks: int):
        self.ranks, self.hash_calls = ranks, 0

    def hash_checkpoint_files(self, path: str, sizes: dict) -> list[dict]:
        self.hash_calls += 1
        return [
            checksums.hash_files(path, checksums.share_of(sizes, rank=r, world=self.ranks)) for r in range(self.ranks)
        ]


def _save(root, identity, step, group=None):
    return save_trainer_checkpoint(
        group or ShardGroup(),
        root=str(root),
        step=step,
        trainer_state={"global_step": step, "loader": {}},
        identity=identity,
    )


def _run_with_saves(root, steps):
    identity, _ = start_run(str(root), resume_mode="auto", resume_from_path=None, config=CONFIG)
    return [_save(root, identity, s) for s in steps]


def _flip(path: str, offset: int = 100, n: int = 64) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in old))


def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


def _record(path: str) -> dict:
    with open(os.path.join(path, COMPLETE_FILE)) as f:
        return json.load(f)


def test_the_completeness_record_lists_every_file_with_its_size_and_checksum(tmp_path):
    (path,) = _run_with_saves(tmp_path, [2])
    on_disk = {}
    for dirpath, _, names in os.walk(path):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), path)
            if rel != COMPLETE_FILE:
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read()
                on_disk[rel] = {"size": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data)}
    assert set(on_disk) == {"shard_0.bin", "shard_1.bin", "hf/config.json", "trainer_state.json"}
    record = _record(path)
    assert record["hash"] == "xxh3_128" and record["files"] == on_disk
    assert record["step"] == 2 and record["lineage_id"]


def test_the_workers_shares_cover_every_file_once_and_give_the_same_manifest(tmp_path):
    sizes = {f"f{i}": size for i, size in enumerate([50, 10, 40, 30, 30, 5, 0])}
    for world in (1, 2, 3, 8):
        shares = [checksums.share_of(sizes, rank=r, world=world) for r in range(world)]
        flat = [name for share in shares for name in share]
        assert sorted(flat) == sorted(sizes), f"world={world}: every file exactly once"
    two = [sum(sizes[n] for n in checksums.share_of(sizes, rank=r, world=2)) for r in range(2)]
    assert sorted(two) == [80, 85]  # largest-first to the least loaded: 50+30+5 | 40+30+10+0

    identity, _ = start_run(str(tmp_path / "a"), resume_mode="auto", resume_from_path=None, config=CONFIG)
    group = RankedShardGroup(ranks=2)
    by_workers = _record(_save(tmp_path / "a", identity, 2, group))["files"]
    assert group.hash_calls == 1
    by_driver = _record(_run_with_saves(tmp_path / "b", [2])[0])["files"]
    assert by_workers == by_driver


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda p: os.remove(os.path.join(p, "hf", "config.json")), "hf/config.json is missing"),
        (lambda p: _truncate(os.path.join(p, "shard_1.bin")), "shard_1.bin has 4096 bytes.*size mismatch"),
        (lambda p: _flip(os.path.join(p, "shard_0.bin")), "shard_0.bin has xxh3_128 .*checksum mismatch"),
        (lambda p: _flip(os.path.join(p, "trainer_state.json"), offset=0, n=1), "trainer_state.json .*checksum"),
    ],
    ids=["missing", "truncated", "flipped", "state_file"],
)
def test_a_missing_truncated_or_altered_file_is_detected_naming_it(tmp_path, damage, problem):
    (path,) = _run_with_saves(tmp_path, [2])
    verify_checkpoint(path)  # intact: passes (the negative control of the damage below)
    damage(path)
    with pytest.raises(CheckpointCorruptError, match=problem):
        verify_checkpoint(path)


@pytest.mark.parametrize("damage", [_flip, _truncate], ids=["flipped_byte", "truncated_shard"])
def test_auto_resume_falls_back_past_a_corrupt_newest_checkpoint_naming_the_file(tmp_path, caplog, damage):
    paths = _run_with_saves(tmp_path, [2, 4, 6])
    tracker = Tracking("p", "e", log_dir=str(tmp_path), backends=["jsonl"], config={}, total_steps=6)
    for step in range(1, 7):
        tracker.log({"train/loss": float(step)}, step=step)
    tracker.close()
    damage(os.path.join(paths[2], "shard_1.bin"))
    with caplog.at_level(logging.WARNING, logger="verl_balance.trainer.checkpoint"):
        identity, loaded = start_run(str(tmp_path), resume_mode="auto", resume_from_path=None, config=CONFIG)
    assert loaded == paths[1] and identity.start_step == 4
    assert "shard_1.bin" in caplog.text and ("size mismatch" in caplog.text or "checksum mismatch" in caplog.text)
    assert not os.path.exists(paths[2]), "the corrupt checkpoint is moved aside, not left as the newest"
    moved = [d for d in os.listdir(tmp_path / "superseded") if d.endswith("corrupt_global_step_6")]
    assert len(moved) == 1 and os.path.exists(tmp_path / "superseded" / moved[0] / "global_step_6" / "shard_0.bin")
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3, 4]


def test_resume_path_to_a_corrupt_checkpoint_is_an_error_naming_the_file_not_another_checkpoint(tmp_path):
    paths = _run_with_saves(tmp_path, [2, 4])
    _flip(os.path.join(paths[1], "shard_0.bin"))
    with pytest.raises(CheckpointCorruptError, match=r"resume_from_path=.*global_step_4.*shard_0.bin"):
        start_run(str(tmp_path), resume_mode="resume_path", resume_from_path=paths[1], config=CONFIG)
    assert os.path.exists(paths[1]) and os.path.exists(paths[0])


def test_when_every_checkpoint_is_corrupt_resume_is_an_error_and_moves_nothing(tmp_path):
    paths = _run_with_saves(tmp_path, [2, 4])
    for path in paths:
        _truncate(os.path.join(path, "shard_0.bin"))
    with pytest.raises(CheckpointCorruptError, match=r"no intact checkpoint.*global_step_4.*global_step_2"):
        start_run(str(tmp_path), resume_mode="auto", resume_from_path=None, config=CONFIG)
    assert all(os.path.exists(p) for p in paths)


def test_a_checkpoint_without_checksums_from_an_older_version_loads_unverified_by_opt_in_with_a_warning(
    tmp_path, caplog
):
    (path,) = _run_with_saves(tmp_path, [2])
    record = _record(path)
    del record["files"], record["hash"]
    with open(os.path.join(path, COMPLETE_FILE), "w") as f:
        json.dump(record, f)
    with caplog.at_level(logging.WARNING, logger="verl_balance.trainer.checkpoint"):
        _, loaded = start_run(
            str(tmp_path), resume_mode="auto", resume_from_path=None, config=CONFIG, allow_unverified=True
        )
    assert loaded == path and "unverified" in caplog.text


def test_the_record_is_written_last_so_a_save_failing_while_hashing_leaves_no_complete_checkpoint(tmp_path):
    identity, _ = start_run(str(tmp_path), resume_mode="auto", resume_from_path=None, config=CONFIG)
    _save(tmp_path, identity, 2)

    class FailingHash(RankedShardGroup):
        def hash_checkpoint_files(self, path, sizes):
            raise RuntimeError("a worker died while hashing")

    with pytest.raises(RuntimeError, match="hashing"):
        _save(tmp_path, identity, 4, FailingHash(ranks=2))
    complete, _ = checkpoint.scan_checkpoints(str(tmp_path))
    assert [c.step for c in complete] == [2]
