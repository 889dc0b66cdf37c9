"""The pieces of ``trainer.v1.trainer_mode`` that need no workers: verl's keys and their checks, the
choice of trainer, the loader peek, the rollout-side split, the merge, the sampler and the bucket
plan, each against a hand-worked or single-path reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.trainer.conftest import compose_config
from verl_balance.rollout import RolloutOutput
from verl_balance.trainer.config.checks import ConfigError
from verl_balance.trainer.config.grpo import register_grpo_schema, validate_grpo
from verl_balance.trainer.grpo.async_trainer import (
    AsyncGRPOTrainer,
    assign_prompts,
    grpo_trainer_class,
    is_weight_metrics,
    merge_assigned_outputs,
    peek_loader_item,
    stale_rows,
)
from verl_balance.trainer.grpo.trainer import GRPOTrainer
from verl_balance.workers.weight_sync import plan_buckets

ASYNC = [
    "trainer.device=cpu",
    "trainer.v1.trainer_mode=separate_async",
    "actor_rollout_ref.rollout.nnodes=1",
    "trainer.v1.separate_async.parameter_sync_step=2",  # 16 prompts / mini-batches of 8
]

COLOCATE = ["trainer.v1.trainer_mode=colocate_async"]


def _config(overrides):
    register_grpo_schema()
    return compose_config("grpo", overrides)


def test_default_and_explicit_sync_run_the_unchanged_synchronous_trainer():
    default, explicit = _config(["trainer.device=cpu"]), _config(["trainer.device=cpu", "trainer.v1.trainer_mode=sync"])
    assert grpo_trainer_class(default) is GRPOTrainer and grpo_trainer_class(explicit) is GRPOTrainer
    assert validate_grpo(default) == validate_grpo(explicit)  # the same typed recipe: the same run, bit for bit
    assert grpo_trainer_class(_config(ASYNC)) is AsyncGRPOTrainer


def test_colocate_async_runs_the_async_trainer_with_its_own_warmup_key():
    config = _config(["trainer.device=cpu", *COLOCATE, "trainer.v1.colocate_async.num_warmup_batches=2"])
    assert grpo_trainer_class(config) is AsyncGRPOTrainer
    v1 = validate_grpo(config).trainer.v1
    assert v1.lookahead == 2 and v1.separate_async.num_warmup_batches == 1  # the mode's own key is read


def test_synchronous_trainer_refuses_an_async_mode_before_starting_anything(tmp_path):
    with pytest.raises(ConfigError, match="trainer.v1.trainer_mode='separate_async'"):
        GRPOTrainer(_config(ASYNC + [f"trainer.default_local_dir={tmp_path}"]))
    assert not any(tmp_path.iterdir())  # failed before the run directory was taken


def test_rollout_pool_size_defaults_to_the_trainer_gpus_per_node_as_in_verl():
    config = validate_grpo(_config(ASYNC + ["trainer.n_gpus_per_node=3"]))
    assert config.actor_rollout_ref.rollout.n_gpus_per_node == 3
    assert config.actor_rollout_ref.rollout.rollout_workers == 3


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (COLOCATE + ["trainer.v1.colocate_async.num_warmup_batches=9"], "trainer.v1.colocate_async.num_warmup_batches"),
        (COLOCATE + ["algorithm.adv_estimator=remax"], "algorithm.adv_estimator"),
        (COLOCATE + ["trainer.v1.colocate_async.num_warmup_batches=0"], "num_warmup_batches"),
        (["trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.rollout.nnodes=-1"], "rollout.nnodes"),
        (ASYNC + ["trainer.v1.separate_async.parameter_sync_step=3"], "parameter_sync_step"),
        (ASYNC + ["trainer.v1.separate_async.num_warmup_batches=9"], "max_off_policy_threshold"),
        (ASYNC + ["trainer.v1.sampler.max_off_policy_strategy=later"], "trainer.v1.sampler.max_off_policy_strategy"),
        (ASYNC + ["trainer.v1.sampler.max_off_policy_threshold=0"], "trainer.v1.sampler.max_off_policy_threshold"),
        (ASYNC + ["algorithm.adv_estimator=gae"], "algorithm.adv_estimator"),
    ],
)
def test_invalid_async_settings_fail_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_grpo(_config(["trainer.device=cpu"] + overrides))


def test_wait_strategy_caps_the_lookahead_at_the_threshold():
    overrides = ASYNC + [
        "trainer.v1.separate_async.num_warmup_batches=5",
        "trainer.v1.sampler.max_off_policy_strategy=wait",
        "trainer.v1.sampler.max_off_policy_threshold=2",
    ]
    assert validate_grpo(_config(overrides)).trainer.v1.lookahead == 2
    assert validate_grpo(_config(ASYNC)).trainer.v1.lookahead == 1


class _Dataset(list):
    pass


def test_loader_peek_yields_the_items_the_loader_yields_next_across_epochs():
    from verl_balance.data.loader import StatefulDataLoader

    loader = StatefulDataLoader(_Dataset(range(10)), batch_size=3, collate_fn=list, shuffle=True, seed=7)
    seen, peeked = [], {}
    for _ in range(3):  # 3 epochs of 3 batches
        for item in loader:
            position = len(seen)
            seen.append(item)
            for ahead in (1, 2, 4):
                peeked.setdefault(position + ahead, []).append(peek_loader_item(loader, ahead))
    for position, items in peeked.items():
        if position < len(seen):
            assert all(item == seen[position] for item in items), position


def test_rollout_split_balances_predicted_tokens_and_places_every_prompt_once():
    costs = np.array([900.0, 800, 100, 100, 100, 100, 700, 600])  # long prompts bunched at the ends
    parts, predicted = assign_prompts(costs, num_workers=2)
    assert sorted(np.concatenate(parts).tolist()) == list(range(8))
    assert abs(len(parts[0]) - len(parts[1])) <= 1
    loads = [costs[p].sum() for p in parts]
    assert predicted["rollout/imbalance_predicted"] == pytest.approx(max(loads) / np.mean(loads))
    # the contiguous split puts 1900 vs 1500; {900, 600, 100, 100} vs {800, 700, 100, 100} is exact
    assert predicted["rollout/imbalance_predicted_naive"] == pytest.approx(1900 / 1700)
    assert predicted["rollout/imbalance_predicted"] == pytest.approx(1.0)


def _output(prompt_ids: list[int], *, n: int, width: int) -> RolloutOutput:
    """Responses whose tokens encode (prompt, sample): row of prompt p, sample j = [10p + j, ...]."""
    rows = [(p, j) for p in range(len(prompt_ids)) for j in range(n)]
    responses = torch.tensor([[10 * prompt_ids[p] + j] * width for p, j in rows])
    return RolloutOutput(
        prompt_index=np.array([p for p, _ in rows]),
        responses=responses,
        response_mask=torch.ones_like(responses),
        response_lengths=torch.full((len(rows),), width),
        finish_reasons=np.array(["length"] * len(rows), dtype=object),
        log_probs=responses.float() / 100,
    )


def test_merge_of_assigned_outputs_restores_the_prompt_major_order():
    parts = [np.array([4, 0, 2]), np.array([1, 3])]
    outputs = [_output(parts[0].tolist(), n=2, width=3), _output(parts[1].tolist(), n=2, width=2)]
    merged = merge_assigned_outputs(outputs, parts, pad_token_id=0)
    reference = _output([0, 1, 2, 3, 4], n=2, width=3)  # one worker answering in order
    assert merged.prompt_index.tolist() == reference.prompt_index.tolist()
    assert merged.responses[:, 0].tolist() == reference.responses[:, 0].tolist()
    assert merged.responses[2].tolist() == [10, 10, 0]  # prompt 1's rows were 2 wide: right-padded


def test_sampler_marks_rows_staler_than_the_threshold():
    versions = np.array([5, 4, 3, 3, 2])
    assert stale_rows(versions, current=5, threshold=2).tolist() == [False, False, False, False, True]
    assert not stale_rows(versions, current=5, threshold=3).any()


def test_importance_weight_statistics_match_a_hand_computation():
    from verl_balance.batch_keys import LOSS_MASK_KEY, OLD_LOG_PROBS_KEY, ROLLOUT_LOG_PROBS_KEY
    from verl_balance.protocol import Batch

    actor = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    rollout = torch.tensor([[-1.5, -1.0, -9.0], [-0.25, -9.0, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    batch = Batch.from_dict(tensors={OLD_LOG_PROBS_KEY: actor, ROLLOUT_LOG_PROBS_KEY: rollout, LOSS_MASK_KEY: mask})
    out = is_weight_metrics(batch)
    token = np.exp([0.5, -1.0, -0.25])
    sequence = np.exp([-0.5, -0.25])
    assert out["off_policy/is_weight_token_mean"] == pytest.approx(token.mean())
    assert out["off_policy/is_weight_token_max"] == pytest.approx(token.max())
    assert out["off_policy/is_weight_sequence_mean"] == pytest.approx(sequence.mean())
    assert out["off_policy/is_weight_sequence_min"] == pytest.approx(sequence.min())


def test_weight_buckets_keep_order_cover_every_tensor_and_respect_the_size():
    sizes = [("a", 40), ("b", 70), ("c", 200), ("d", 10), ("e", 20)]
    buckets = plan_buckets(sizes, bucket_bytes=100)
    assert buckets == [["a"], ["b"], ["c"], ["d", "e"]]
    assert plan_buckets(sizes, bucket_bytes=1000) == [["a", "b", "c", "d", "e"]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(sizes, bucket_bytes=0)


def _in_flight_output(seed: int = 0) -> RolloutOutput:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([3, 1, 2, 3])
    mask = (torch.arange(3)[None, :] < lengths[:, None]).long()
    return RolloutOutput(
        prompt_index=np.array([0, 0, 1, 1]),
        responses=torch.randint(1, 50, (4, 3), generator=gen) * mask,
        response_mask=mask,
        response_lengths=lengths,
        finish_reasons=np.array(["length", "stop", "stop", "length"], dtype=object),
        log_probs=-torch.rand(4, 3, generator=gen) * mask,
    )


def test_an_in_flight_batch_round_trips_through_its_checkpoint_file_exactly(tmp_path):
    from verl_balance.trainer.grpo.async_checkpoint import in_flight_file, load_rollout_output, save_rollout_output

    original, path = _in_flight_output(), str(tmp_path / in_flight_file(3))
    save_rollout_output(path, original, version=2, predicted={"rollout/imbalance_predicted": 1.25})
    restored, version, predicted = load_rollout_output(path)
    assert version == 2 and predicted == {"rollout/imbalance_predicted": 1.25}
    for name in ("responses", "response_mask", "response_lengths", "log_probs"):
        assert torch.equal(getattr(restored, name), getattr(original, name)), name
        assert getattr(restored, name).dtype == getattr(original, name).dtype, name
    assert restored.prompt_index.tolist() == [0, 0, 1, 1]
    assert restored.finish_reasons.tolist() == ["length", "stop", "stop", "length"]
    other, _, _ = load_rollout_output(_saved(tmp_path / "other.safetensors", _in_flight_output(seed=1)))
    assert not torch.equal(other.log_probs, original.log_probs)  # negative control: the file is what is read


def _saved(path, output) -> str:
    from verl_balance.trainer.grpo.async_checkpoint import save_rollout_output

    save_rollout_output(str(path), output, version=0, predicted={})
    return str(path)


def test_a_missing_or_linked_in_flight_file_is_refused_naming_it(tmp_path):
    from verl_balance.trainer.checkpoint import CheckpointError
    from verl_balance.trainer.grpo.async_checkpoint import load_rollout_output
    from verl_balance.utils.atomic_io import UnsafePathError

    with pytest.raises(CheckpointError, match="in_flight_7.safetensors is missing"):
        load_rollout_output(str(tmp_path / "in_flight_7.safetensors"))
    target = _saved(tmp_path / "elsewhere.safetensors", _in_flight_output())
    (tmp_path / "in_flight_8.safetensors").symlink_to(target)
    with pytest.raises(UnsafePathError, match="in_flight_8.safetensors is a symbolic link"):
        load_rollout_output(str(tmp_path / "in_flight_8.safetensors"))
