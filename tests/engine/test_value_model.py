"""The value model (models/value.py) in TrainEngine and verl's clipped value loss.

References are independent of the engine: verl's own ``compute_value_loss`` for the loss, a plain
per-sequence (unpacked) forward of the value model for the values, HF's
``Qwen2ForTokenClassification.logits`` for an HF checkpoint. The layout parity of the value loss
(layouts x fixed / token-capped micro-batches x every agg mode, with negative controls) is part of
the parity matrix (verl_balance/parity.py ``value_cases``; tests/parity/test_parity_matrix.py).
"""

from __future__ import annotations

import pytest
import torch

from tests._verl import VERL_SKIP_REASON
from verl_balance.algorithms.value_loss import ValueLoss, ValueLossConfigError
from verl_balance.distributed import ParallelLayout
from verl_balance.distributed.launcher import gloo_group, new_rendezvous
from verl_balance.engine import TrainEngine
from verl_balance.engine.config import EngineConfig, EngineConfigError
from verl_balance.loss import AGG_MODES, compute_token_weights
from verl_balance.parity import ParitySettings, make_value_batch, reference_value_model

SETTINGS = ParitySettings(num_samples=6, seed=11)


@pytest.fixture(scope="module")
def single_rank():
    """A one-rank gloo group in this process (TrainEngine's collectives need one)."""
    with gloo_group(rank=0, world_size=1, init_method=new_rendezvous()):
        yield ParallelLayout(dp=1, sp=1, device_type="cpu")


def _value_engine(layout, *, model_config=None, seed=SETTINGS.seed, agg_mode="token-mean") -> TrainEngine:
    config = EngineConfig(
        model_type="value_model", seed=seed, loss_agg_mode=agg_mode, loss_scale_factor=8.0, attn_impl="sdpa_masked"
    )
    return TrainEngine(model_config=model_config or SETTINGS.model, engine_config=config, layout=layout)


def _split(batch: dict[str, torch.Tensor], sizes: list[int]) -> list[dict[str, torch.Tensor]]:
    out, start = [], 0
    for n in sizes:
        out.append({k: v[start : start + n] for k, v in batch.items()})
        start += n
    return out


# ---------------------------------------------------------------------------- the loss vs verl
@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_value_loss_under_the_contract_equals_verl_compute_value_loss(agg_mode):
    compute_value_loss = pytest.importorskip("verl.trainer.ppo.core_algos", reason=VERL_SKIP_REASON).compute_value_loss

    gen = torch.Generator().manual_seed(3)
    b, length, clip, scale = 5, 9, 0.2, 8.0
    vpreds = torch.randn(b, length, generator=gen)
    old = vpreds + 0.4 * torch.randn(b, length, generator=gen)
    returns = torch.randn(b, length, generator=gen)
    mask = (torch.rand(b, length, generator=gen) > 0.3).float()
    mask[2] = 0  # a sequence without loss tokens counts in no mode
    expected_loss, expected_clipfrac = compute_value_loss(
        vpreds=vpreds,
        returns=returns,
        values=old,
        response_mask=mask,
        cliprange_value=clip,
        loss_agg_mode=agg_mode,
        loss_scale_factor=scale,
    )
    per_token, metrics = ValueLoss(cliprange_value=clip)(
        values=vpreds.flatten(), inputs={"values": old.flatten(), "returns": returns.flatten()}
    )
    weights = compute_token_weights(
        loss_masks=[mask.flatten()],
        cu_seqlens=[torch.arange(0, b * length + 1, length)],
        agg_mode=agg_mode,
        loss_scale_factor=scale,
        dp_group=None,
    ).weights[0]
    torch.testing.assert_close((weights * per_token).sum(), expected_loss, rtol=1e-6, atol=0)
    token_mean = (mask.flatten() * metrics["vf_clipfrac"]).sum() / mask.sum()
    torch.testing.assert_close(token_mean, torch.as_tensor(expected_clipfrac, dtype=torch.float32))
    assert 0 < float(token_mean) < 1, "the data must exercise both branches of the clip"
    torch.testing.assert_close(
        (mask.flatten() * metrics["vpred_mean"]).sum() / mask.sum(), (vpreds * mask).sum() / mask.sum()
    )


def test_value_loss_names_a_missing_column_and_refuses_a_bad_clip_range():
    with pytest.raises(ValueLossConfigError, match="returns"):
        ValueLoss(cliprange_value=0.5)(values=torch.zeros(3), inputs={"values": torch.zeros(3)})
    with pytest.raises(ValueLossConfigError, match="cliprange_value"):
        ValueLoss(cliprange_value=0.0)


# ---------------------------------------------------------------------------- the model in the engine
def test_value_engine_holds_no_lm_head_and_the_seeded_backbone_and_head(single_rank):
    engine = _value_engine(single_rank)
    state = engine.full_state_dict()
    assert not any(k.startswith("lm_head") for k in state)
    assert state["score.weight"].shape == (1, SETTINGS.model.hidden_size) and "score.bias" in state
    reference = reference_value_model(SETTINGS).state_dict()
    assert state.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
    # The backbone is the language model's at the same seed (the critic starts from the actor's init).
    lm = TrainEngine(
        model_config=SETTINGS.model, engine_config=EngineConfig(seed=SETTINGS.seed), layout=single_rank
    ).full_state_dict()
    for name, value in state.items():
        if not name.startswith("score."):
            torch.testing.assert_close(value, lm[name], rtol=0, atol=0, msg=name)


def _plain_values(model, batch) -> torch.Tensor:
    """values[i, t] = head(hidden of token t - 1), one plain forward per sequence (no packing)."""
    out = torch.zeros(batch["input_ids"].shape)
    with torch.no_grad():
        for i, length in enumerate(batch["attention_mask"].sum(1).tolist()):
            ids = batch["input_ids"][i, :length]
            v = model(
                input_ids=ids,
                position_ids=torch.arange(length),
                cu_seqlens=torch.tensor([0, length]),
                max_seqlen=length,
            )
            out[i, 1:length] = v[:-1]
    return out


def test_compute_values_equal_a_plain_unpacked_forward_shifted_like_log_probs(single_rank):
    engine = _value_engine(single_rank)
    batch = make_value_batch(SETTINGS)
    micro_batches = _split(batch, [2, 3, 1])
    got = torch.cat([out["values"] for out in engine.compute_values(micro_batches)])
    expected = _plain_values(reference_value_model(SETTINGS), batch)
    assert got.shape == batch["input_ids"].shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert (got[:, 0] == 0).all() and (got[batch["attention_mask"] == 0] == 0).all()


def test_value_steps_lower_the_value_loss_on_a_fixed_batch(single_rank):
    engine = _value_engine(single_rank)
    micro_batches = _split(make_value_batch(SETTINGS), [3, 3])
    loss_fn = ValueLoss(cliprange_value=10.0)
    losses = [engine.train_batch(micro_batches, loss_fn=loss_fn) for _ in range(3)]
    assert losses[-1]["loss"] < losses[0]["loss"]
    assert {"vf_clipfrac", "vpred_mean", "grad_norm"} <= set(losses[0])


def test_value_engine_refuses_language_model_calls_and_a_missing_loss(single_rank):
    engine = _value_engine(single_rank)
    micro_batches = _split(make_value_batch(SETTINGS), [6])
    with pytest.raises(EngineConfigError, match="compute_log_prob needs model_type='language_model'"):
        engine.compute_log_prob(micro_batches)
    with pytest.raises(EngineConfigError, match="needs a value loss_fn"):
        engine.train_batch(micro_batches)
    with pytest.raises(EngineConfigError, match="model_type="):
        EngineConfig(model_type="reward_model")
    with pytest.raises(EngineConfigError, match="lora_rank"):
        EngineConfig(model_type="value_model", lora_rank=4)


# ---------------------------------------------------------------------------- HF checkpoints
@pytest.fixture(scope="module")
def tiny_qwen2_dirs(tmp_path_factory):
    """(causal-LM dir, token-classification dir with num_labels=1) of one tiny Qwen2 backbone."""
    from transformers import AutoModelForTokenClassification

    from verl_balance.models.tiny_hf import write_tiny_model

    root = tmp_path_factory.mktemp("value_hf")
    lm_dir = write_tiny_model(str(root / "lm"), family="qwen2", initializer_range=0.02)
    torch.manual_seed(5)
    critic = AutoModelForTokenClassification.from_pretrained(lm_dir, num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        critic.score.bias.fill_(0.25)  # a non-zero bias must be loaded too
    critic.save_pretrained(str(root / "critic"))
    return lm_dir, str(root / "critic")


def test_hf_token_classification_checkpoint_loads_its_score_and_gives_hf_logits(single_rank, tiny_qwen2_dirs, tmp_path):
    from transformers import AutoModelForTokenClassification

    from verl_balance.models.hf import HFModelConfig

    _, critic_dir = tiny_qwen2_dirs
    engine = _value_engine(single_rank, model_config=HFModelConfig.from_pretrained(critic_dir))
    hf = AutoModelForTokenClassification.from_pretrained(critic_dir, dtype=torch.float32).eval()
    batch = make_value_batch(ParitySettings(num_samples=4, seed=2))
    batch["input_ids"] = batch["input_ids"] % hf.config.vocab_size
    got = torch.cat([out["values"] for out in engine.compute_values(_split(batch, [3, 1]))])
    expected = torch.zeros(got.shape)
    with torch.no_grad():
        for i, length in enumerate(batch["attention_mask"].sum(1).tolist()):
            logits = hf(input_ids=batch["input_ids"][i : i + 1, :length]).logits[0, :, 0]
            expected[i, 1:length] = logits[:-1]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(engine.full_state_dict()["score.bias"], torch.tensor([0.25]))
    # The export is again a token-classification checkpoint with the engine's weights.
    out = str(tmp_path / "export")
    engine.save_hf_model(out)
    exported = AutoModelForTokenClassification.from_pretrained(out, dtype=torch.float32).eval()
    assert exported.config.architectures == ["Qwen2ForTokenClassification"] and exported.config.num_labels == 1
    for name, value in exported.state_dict().items():
        torch.testing.assert_close(value, hf.state_dict()[name], rtol=0, atol=0, msg=name)


def test_hf_causal_lm_checkpoint_gets_the_seeded_head_and_its_own_backbone(single_rank, tiny_qwen2_dirs):
    from safetensors.torch import load_file

    from verl_balance.engine.materialize import value_head_init
    from verl_balance.models.hf import HFModelConfig

    lm_dir, _ = tiny_qwen2_dirs
    state = _value_engine(single_rank, model_config=HFModelConfig.from_pretrained(lm_dir), seed=9).full_state_dict()
    on_disk = load_file(f"{lm_dir}/model.safetensors")
    assert "lm_head.weight" not in state
    for name, value in on_disk.items():
        if name != "lm_head.weight":
            torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
    head = value_head_init("score.weight", tuple(state["score.weight"].shape), seed=9, std=0.02)
    torch.testing.assert_close(state["score.weight"], head, rtol=0, atol=0)
    assert (state["score.bias"] == 0).all()
