"""The SFT driver end to end on an embedded Ray cluster of CPU workers.

References are independent of the code under test where possible: the overrides are read back
from the worker processes, loss decrease is judged against the first step, layout parity
compares the (4,1), (2,2) and (1,4) runs against each other (the engine's parity suite compares
each layout against a single-process reference), and resume is compared against an
uninterrupted run of the same config.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.trainer.conftest import compose_config, run_cli_in_process, run_trainer, train_sft
from verl_balance.data.io import MalformedRowError
from verl_balance.trainer.config import ConfigError, validate_sft

pytestmark = pytest.mark.slow


def test_short_sft_run_lowers_the_loss(ray_cluster, tiny_sft_overrides):
    records = train_sft(
        tiny_sft_overrides
        + [
            "trainer.n_gpus_per_node=2",
            "trainer.total_training_steps=12",
            "optim.lr=3e-3",
            "trainer.test_freq=12",
        ]
    )
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == 12
    assert np.mean(losses[-3:]) < losses[0] - 0.3, losses
    assert "val/loss" in records[-1] and np.isfinite(records[-1]["val/loss"])


# Non-default values the workers must report (describe) on the 2x2 run of the layout fixture.
CLI_OVERRIDES = [
    "optim.lr=0.0123",
    "model.hidden_size=48",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "loss_agg_mode=seq-mean-token-mean",
]


@pytest.fixture(scope="module")
def layout_runs(ray_cluster, tmp_path_factory) -> dict:
    """The same dynamic-bsz, balanced SFT config (with CLI_OVERRIDES) for 3 steps on 4 workers as
    dp x sp = 4x1, 2x2 and 1x4: {"curves": {(dp, sp): losses}, "ranks": the 2x2 workers' describe(),
    "vocab_size": the tokenizer's}."""
    from verl_balance.trainer.sft_trainer import SFTTrainer

    root = tmp_path_factory.mktemp("sft_layouts")
    out = {"curves": {}}
    for dp, sp in ((4, 1), (2, 2), (1, 4)):
        overrides = [
            "trainer.device=cpu",
            "model.name=tiny",
            "data.train_batch_size=16",
            "data.synthetic.num_train=128",
            "data.synthetic.num_val=32",
            f"data.synthetic.out_dir={root / 'data'}",
            "trainer.logger=[jsonl]",
            "trainer.plot=false",
            f"trainer.default_local_dir={root / f'run_dp{dp}_sp{sp}'}",
            "trainer.resume_mode=disable",
            "trainer.n_gpus_per_node=4",
            f"ulysses_sequence_parallel_size={sp}",
            "data.use_dynamic_bsz=true",
            "data.max_token_len_per_gpu=256",
            "data.balance_dp_token=true",
            "trainer.total_training_steps=3",
            *CLI_OVERRIDES,
        ]
        trainer = SFTTrainer(compose_config("sft", overrides))
        if (dp, sp) == (2, 2):
            out["ranks"], out["vocab_size"] = trainer.actor.describe(), trainer.tokenizer.vocab_size
        out["curves"][(dp, sp)] = np.array([r["train/loss"] for r in run_trainer(trainer)])
    return out


def test_cli_overrides_reach_the_workers(layout_runs):
    ranks = layout_runs["ranks"]
    assert [(r["dp_rank"], r["sp_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in ranks:
        assert (r["dp"], r["sp"]) == (2, 2)
        assert r["engine"]["optim"]["lr"] == pytest.approx(0.0123)
        assert r["engine"]["loss_agg_mode"] == "seq-mean-token-mean"
        assert r["model"]["hidden_size"] == 48
        assert r["model"]["vocab_size"] == layout_runs["vocab_size"]


def test_loss_curve_is_identical_on_4x1_2x2_1x4_with_dynamic_bsz(layout_runs):
    """The seed bug this guards: with balance_dp_token on, sp=2 logged half the sp=1 loss."""
    curves = layout_runs["curves"]
    reference = curves[(4, 1)]
    assert len(reference) == 3
    for layout, curve in curves.items():
        np.testing.assert_allclose(curve, reference, rtol=1e-5, err_msg=f"layout {layout}")


def test_resume_after_ctrl_c_continues_the_curve_exactly(sft_reference_runs):
    runs = sft_reference_runs
    (_, straight), (_, first), (_, resumed) = runs["straight"], runs["first"], runs["resumed"]
    assert [r["step"] for r in first] == [1, 2, 3], "Ctrl-C must stop after the current step"
    # save_freq=2: the step-3 checkpoint is the one the stop saved
    assert runs["latest_after_first"] == "3"
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    np.testing.assert_allclose([r["train/loss"] for r in resumed], [r["train/loss"] for r in straight], rtol=1e-6)
    np.testing.assert_allclose(
        [r["train/grad_norm"] for r in resumed], [r["train/grad_norm"] for r in straight], rtol=1e-6
    )


def test_unknown_key_fails_at_startup_naming_it(monkeypatch, capsys):
    code, stderr = run_cli_in_process(
        "verl_balance.main_sft", ["data.train_batch_sise=8"], monkeypatch=monkeypatch, capsys=capsys
    )
    assert code != 0
    assert "train_batch_sise" in stderr


@pytest.mark.parametrize(
    "override, key",
    [
        ("loss_agg_mode=mean", "loss_agg_mode"),
        ("ulysses_sequence_parallel_size=3", "ulysses_sequence_parallel_size"),
        ("data.truncation=middle", "data.truncation"),
        ("balance.workload=time", "balance.workload"),
        ("loss_agg_mode=seq-mean-token-sum-norm", "loss_scale_factor"),
    ],
)
def test_invalid_values_fail_naming_the_key(override, key):
    cfg = compose_config("sft", [override])
    with pytest.raises(ConfigError, match=key):
        validate_sft(cfg)


def test_malformed_row_fails_naming_file_and_row(tmp_path, tiny_sft_overrides):
    from verl_balance.trainer.sft_trainer import SFTTrainer

    path = tmp_path / "bad.jsonl"
    rows = [{"prompt": "1+1=", "response": "2"}, {"prompt": "2+2="}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = compose_config("sft", tiny_sft_overrides + [f"data.train_files={path}", f"data.val_files={path}"])
    with pytest.raises(MalformedRowError, match=r"bad\.jsonl.*row 1|row 1.*bad\.jsonl"):
        SFTTrainer(cfg)


def test_overlong_sample_fails_at_startup_naming_file_and_row(tmp_path, tiny_sft_overrides):
    """balance.overlong=error is checked on every train and val sample before any worker starts."""
    from verl_balance.data.io import SequenceTooLongError
    from verl_balance.trainer.sft_trainer import SFTTrainer

    path = tmp_path / "long.jsonl"
    rows = [{"prompt": "1+1=", "response": "2"}] * 3 + [{"prompt": "x" * 300, "response": "y"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = compose_config(
        "sft",
        tiny_sft_overrides
        + [
            f"data.train_files={path}",
            f"data.val_files={path}",
            "data.train_batch_size=2",
            "trainer.n_gpus_per_node=2",
            "data.use_dynamic_bsz=true",
            "data.max_token_len_per_gpu=128",
        ],
    )
    with pytest.raises(SequenceTooLongError, match=r"long\.jsonl.*row 3.*data\.max_token_len_per_gpu"):
        SFTTrainer(cfg)
