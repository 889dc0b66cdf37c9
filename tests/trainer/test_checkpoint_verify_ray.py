"""Verified checkpoints end to end (embedded Ray, 2 CPU workers, tiny model): the workers hash
the checkpoint's files, and a resume falls back past a corrupt newest checkpoint.

Reference: the uninterrupted run's own losses and grad norms (the shared ``sft_reference_runs``
straight run, copied before any damage); the resumed runs must reproduce steps 3-4 from the step-2
checkpoint exactly.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np
import pytest

from tests.trainer.conftest import compose_config
from verl_balance.trainer.checkpoint import verify_checkpoint
from verl_balance.utils.tracking import read_metrics

pytestmark = pytest.mark.slow


def _fit(overrides) -> dict:
    from verl_balance.trainer.sft_trainer import SFTTrainer

    trainer = SFTTrainer(compose_config("sft", overrides))
    try:
        return trainer.fit()
    finally:
        trainer.close()


def _flip_64_bytes(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(b"\xff" * 64)


def test_resume_falls_back_past_a_flipped_byte_and_a_truncated_shard_and_matches_the_uninterrupted_curve(
    sft_reference_runs, tmp_path, caplog
):
    # The uninterrupted run (checkpoints at steps 2 and 4) is the shared reference run, copied: it is damaged here.
    run = tmp_path / "run"
    shutil.copytree(sft_reference_runs["root"] / "straight", run)
    base = sft_reference_runs["base"] + [f"trainer.default_local_dir={run}"]
    expected = read_metrics(str(run))
    assert [r["step"] for r in expected] == [1, 2, 3, 4]
    with open(run / "global_step_4" / "checkpoint_complete.json") as f:
        listed = set(json.load(f)["files"])
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "engine_state.pt", "trainer_state.json"} <= listed
    assert listed == {
        os.path.relpath(os.path.join(d, n), run / "global_step_4")
        for d, _, names in os.walk(run / "global_step_4")
        for n in names
        if n != "checkpoint_complete.json"
    }

    damages = [
        ("__1_0.distcp", _flip_64_bytes, "checksum mismatch"),
        ("__0_0.distcp", lambda p: os.truncate(p, os.path.getsize(p) // 2), "size mismatch"),
    ]
    for attempt, (shard, damage, problem) in enumerate(damages, start=1):
        damage(str(run / "global_step_4" / shard))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="verl_balance.trainer.checkpoint"):
            summary = _fit(base + ["trainer.resume_mode=auto"])
        assert shard in caplog.text and problem in caplog.text, caplog.text
        assert summary["steps"] == 4
        records = read_metrics(str(run))
        raw_steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert raw_steps == [1, 2, 3, 4], f"{shard}: resumed from step 2, steps 3-4 logged once"
        corrupt = [d for d in os.listdir(run / "superseded") if d.endswith("corrupt_global_step_4")]
        assert len(corrupt) == attempt, "each corrupt checkpoint is moved aside, not deleted"
        verify_checkpoint(str(run / "global_step_4"))  # steps 3-4 were redone and saved intact
        for key in ("train/loss", "train/grad_norm"):
            np.testing.assert_allclose([r[key] for r in records], [r[key] for r in expected], rtol=1e-6, err_msg=key)
