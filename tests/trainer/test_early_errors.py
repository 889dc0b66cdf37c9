"""Mistakes whose facts are known before Ray starts fail before it, naming the key; the rest name
what they can (the sample of a failing reward call, the keys of a group too large for the
cluster); metrics are strict JSON; the embedded Ray start survives a timed-out node start-up. No
Ray: ``cluster.start_ray`` is replaced by a function that fails the test if it is reached."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from tests.trainer.conftest import compose_config
from verl_balance.data import ByteTokenizer, RLDataConfig, RLPromptDataset
from verl_balance.data.rl_dataset import DataError
from verl_balance.rewards.score import score_batch
from verl_balance.single_controller import UnplaceableResourcePoolError
from verl_balance.trainer import cluster, ray_start
from verl_balance.trainer.config import ConfigError, validate_sft
from verl_balance.trainer.driver import exit_code
from verl_balance.utils.tracking import NONFINITE_KEY, Tracking, read_metrics


@pytest.fixture
def no_ray(monkeypatch):
    """Reaching Ray's start-up fails the test: the error must come before it."""

    def started(**kwargs):
        raise AssertionError("Ray was started before the error")

    monkeypatch.setattr(cluster, "start_ray", started)


def _sft(overrides: list[str]):
    from verl_balance.trainer.sft_trainer import SFTTrainer

    trainer = SFTTrainer(compose_config("sft", overrides))
    trainer.close()


def _base(tmp_path) -> list[str]:
    return [
        "data.train_batch_size=12",
        "data.synthetic.num_train=24",
        "data.synthetic.num_val=0",
        f"data.synthetic.out_dir={tmp_path / 'data'}",
        "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    ]


@pytest.mark.parametrize("source", ["preset", "config_json"])
def test_a_ulysses_degree_that_does_not_split_the_heads_fails_before_ray_naming_the_key(
    tmp_path, no_ray, source, request
):
    model = "model.name=tiny" if source == "preset" else f"model.path={request.getfixturevalue('tiny_qwen2')}"
    overrides = _base(tmp_path) + [model, "trainer.device=cpu", "trainer.n_gpus_per_node=3"]
    with pytest.raises(
        ConfigError, match=r"ulysses_sequence_parallel_size=3 does not fit the model of model\.(name|path)"
    ):
        _sft(overrides + ["ulysses_sequence_parallel_size=3"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_device_cuda_without_a_gpu_fails_before_ray_naming_the_key(tmp_path, no_ray):
    with pytest.raises(ConfigError, match=r"trainer\.device=cuda but this machine has no GPU"):
        _sft(_base(tmp_path) + ["model.name=tiny", "trainer.device=cuda"])


def test_a_missing_lora_adapter_path_fails_at_config_time_naming_the_key(tmp_path, tiny_qwen2):
    overrides = [f"model.path={tiny_qwen2}", "model.lora_rank=4", f"model.lora_adapter_path={tmp_path / 'nowhere'}"]
    with pytest.raises(ConfigError, match=r"model\.lora_adapter_path=.*nowhere.*adapter_config\.json"):
        validate_sft(compose_config("sft", overrides + [f"trainer.default_local_dir={tmp_path}"]))


def test_save_freq_zero_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer\.save_freq=0 would never save"):
        validate_sft(compose_config("sft", ["trainer.save_freq=0", f"trainer.default_local_dir={tmp_path}"]))
    validate_sft(compose_config("sft", ["trainer.save_freq=-1", f"trainer.default_local_dir={tmp_path}"]))


@pytest.mark.slow  # calls build_actor_group / start_ray (with Ray replaced), which tests/test_slow_marks.py flags
def test_a_group_larger_than_the_cluster_names_n_gpus_per_node(monkeypatch):
    class Pool:
        removed = False

        def __init__(self, **kwargs):
            pass

        def remove(self):
            Pool.removed = True

    def unplaceable(cls):
        def build(**kwargs):
            raise UnplaceableResourcePoolError("the cluster has 8 CPU slots, the pool needs 16")

        return build

    monkeypatch.setattr(cluster, "RayResourcePool", Pool)
    monkeypatch.setattr(cluster, "group_class_for", unplaceable)
    trainer_cfg = type("T", (), {"n_gpus_per_node": 16, "nnodes": 1, "placement_timeout_s": 1.0})()
    with pytest.raises(ConfigError, match=r"trainer\.n_gpus_per_node=16 x trainer\.nnodes=1 = 16 workers") as err:
        cluster.build_actor_group(worker_config=None, trainer_cfg=trainer_cfg, use_gpu=False)
    assert isinstance(err.value, UnplaceableResourcePoolError) and Pool.removed


def test_a_max_prompt_length_that_filters_every_prompt_names_the_key(tmp_path):
    path = tmp_path / "p.jsonl"
    row = {
        "data_source": "s",
        "prompt": [{"role": "user", "content": "a long prompt"}],
        "reward_model": {"ground_truth": "x"},
    }
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=r"data\.max_prompt_length=2 .*raise data\.max_prompt_length"):
        RLPromptDataset(files=str(path), tokenizer=ByteTokenizer(), config=RLDataConfig(max_prompt_length=2))


def test_a_reward_function_raising_on_one_row_names_the_sample_and_data_source():
    def reward(data_source, solution, ground_truth, extra_info):
        return 1.0 / int(solution)  # ZeroDivisionError on "0"

    with pytest.raises(ZeroDivisionError) as err:  # the user's own exception type is kept
        score_batch(reward_fn=reward, data_sources=["a", "b", "c"], solutions=["1", "0", "2"], ground_truths=[1, 2, 3])
    assert "sample 1 (data_source 'b'" in " ".join(err.value.__notes__)


def test_metrics_are_strict_json_with_non_finite_values_as_null_and_named(tmp_path):
    tracker = Tracking("p", "e", log_dir=str(tmp_path), backends=["jsonl"])
    tracker.log({"train/loss": float("nan"), "train/grad_norm": float("inf"), "train/lr": 0.1}, step=1)
    tracker.close()

    def refuse(token):
        raise ValueError(f"bare {token} is not JSON")

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    record = json.loads(lines[0], parse_constant=refuse)  # what jq and JavaScript accept
    assert record["train/loss"] is None and record["train/grad_norm"] is None and record["train/lr"] == 0.1
    assert record[NONFINITE_KEY] == {"train/loss": "nan", "train/grad_norm": "inf"}
    (read,) = read_metrics(str(tmp_path))
    assert math.isnan(read["train/loss"]) and read["train/grad_norm"] == math.inf and NONFINITE_KEY not in read
    with pytest.raises(ValueError, match="bare NaN"):  # negative control: Python's default writes NaN
        json.loads(json.dumps({"x": float("nan")}), parse_constant=refuse)


def test_exit_codes_tell_a_finished_run_from_an_interrupted_one():
    assert exit_code({"stop_signal": None}) == 0
    assert exit_code({"stop_signal": "SIGINT"}) == 130
    assert exit_code({"stop_signal": "SIGTERM"}) == 143


class _FakeRay:
    """``ray.init`` failing with Ray's node start-up timeout ``failures`` times, then succeeding."""

    def __init__(self, failures: int, message: str = "The current node timed out during startup.") -> None:
        self.failures, self.message, self.inits, self.shutdowns = failures, message, 0, 0

    def is_initialized(self) -> bool:
        return False

    def init(self, **kwargs) -> None:
        self.inits += 1
        if self.inits <= self.failures:
            raise Exception(self.message)

    def shutdown(self) -> None:
        self.shutdowns += 1

    def cluster_resources(self) -> dict:
        return {}


@pytest.mark.slow  # see above
def test_the_embedded_ray_start_is_retried_when_its_node_start_up_times_out(monkeypatch, caplog):
    fake = _FakeRay(failures=2)
    monkeypatch.setattr(cluster, "ray", fake)
    monkeypatch.setattr(ray_start, "ray", fake)
    cluster.start_ray(address=None)
    assert fake.inits == 3 and fake.shutdowns == 2 and caplog.text.count("retrying") == 2
    fake = _FakeRay(failures=ray_start.EMBEDDED_START_ATTEMPTS)
    monkeypatch.setattr(cluster, "ray", fake)
    monkeypatch.setattr(ray_start, "ray", fake)
    with pytest.raises(ray_start.RayStartError, match=r"raylet.*30 s.*trainer\.ray_address"):
        cluster.start_ray(address=None)
    fake = _FakeRay(failures=1, message="some other start-up failure")  # not a timeout: no retry
    monkeypatch.setattr(cluster, "ray", fake)
    monkeypatch.setattr(ray_start, "ray", fake)
    with pytest.raises(Exception, match="some other"):
        cluster.start_ray(address=None)
    assert fake.inits == 1


def test_the_run_directory_is_left_unlocked_after_an_early_error(tmp_path, no_ray):
    with pytest.raises(ConfigError):
        _sft(
            _base(tmp_path)
            + ["model.name=tiny", "trainer.device=cpu", "trainer.n_gpus_per_node=3", "ulysses_sequence_parallel_size=3"]
        )
    from verl_balance.trainer.checkpoint.run_lock import acquire_run_lock

    acquire_run_lock(os.path.join(tmp_path, "run")).release()


@pytest.mark.parametrize("stop_signal, code", [(None, None), ("SIGINT", 130), ("SIGTERM", 143)])
def test_the_entry_point_exits_with_the_stop_signals_code(monkeypatch, tmp_path, stop_signal, code):
    """``python -m verl_balance.main_sft``: 0 (no SystemExit) when finished, 128 + signal after a stop."""
    import runpy

    from verl_balance.trainer.sft_trainer import SFTTrainer

    summary = {"steps": 2, "wall_s": 1.0, "metrics": "m", "stop_signal": stop_signal}
    monkeypatch.setattr(SFTTrainer, "train", classmethod(lambda cls, cfg: summary))
    monkeypatch.setattr("sys.argv", ["main_sft", f"trainer.default_local_dir={tmp_path}"])
    if code is None:
        runpy.run_module("verl_balance.main_sft", run_name="__main__")  # as ``python -m`` runs it
        return
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("verl_balance.main_sft", run_name="__main__")
    assert exit_info.value.code == code
