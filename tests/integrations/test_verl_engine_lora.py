"""LoRA in the verl engine backend: verl's LoRA model keys reach our engine, and the weight sync
(``get_per_tensor_param(layered_summon=, base_sync_done=)``), the reference policy
(``disable_adapter``) and a train step give what verl 0.9.1's own fsdp2 engine gives for the same
model, adapter and batch.

Both engines start from one peft adapter directory (``model.lora_adapter_path``) with a non-zero B,
so the adapters change the logits and every adapter gets a gradient; verl loads it with peft's
``PeftModel.from_pretrained``, ours with its own loader (engine/materialize.py)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tests._adam import assert_same_adam_step, record_step, trainable_state
from tests._verl import VERL_SKIP_REASON

pytest.importorskip("verl", reason=VERL_SKIP_REASON)
pytest.importorskip("peft")

from verl_balance.distributed.launcher import run_on_ranks  # noqa: E402

LORA_TARGETS = ["q_proj", "v_proj", "down_proj"]  # conftest.LORA_TARGETS: the adapter of lora_adapter_dir
NUM_SAMPLES = 6


def _tensordict(vocab: int):
    import torch
    from verl.utils import tensordict_utils as tu

    rng = np.random.default_rng(5)
    ids, masks = [], []
    for length in rng.integers(6, 30, size=NUM_SAMPLES):
        ids.append(torch.as_tensor(rng.integers(3, vocab, size=int(length))))
        mask = torch.ones(int(length), dtype=torch.long)
        mask[:2] = 0
        masks.append(mask)
    return tu.get_tensordict(
        tensor_dict={
            "input_ids": torch.nested.as_nested_tensor(ids, layout=torch.jagged),
            "position_ids": torch.nested.as_nested_tensor([torch.arange(len(x)) for x in ids], layout=torch.jagged),
            "loss_mask": torch.nested.as_nested_tensor(masks, layout=torch.jagged),
        },
        non_tensor_dict={
            "use_remove_padding": False,
            "use_dynamic_bsz": True,
            "max_token_len_per_gpu": 64,
            "micro_batch_size_per_gpu": None,
            "temperature": 1.0,
            "global_batch_size": NUM_SAMPLES,
            "pad_mode": "no_padding",
        },
    )


def _numpy(pairs) -> dict:
    return {name: t.detach().cpu().double().numpy() for name, t in pairs}


def _lora_engine_run(rank: int, *, model_dir: str, adapter: str, strategy: str) -> dict:
    """One verl sft train step with LoRA, then every weight-sync export and the log-probs with and
    without the adapters (verl's reference policy), on a world of 1."""
    import torch
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.utils.losses import sft_loss

    from verl_balance.integrations.verl import engine as verl_engine
    from verl_balance.integrations.verl.cpu_shims import platform as cpu_platform  # noqa: F401  (importing installs it on CPU)

    model_config = HFModelConfig(
        path=model_dir,
        use_remove_padding=False,
        override_config={"attn_implementation": "sdpa"},
        lora_rank=8,  # the adapter's own rank (4) is used, in both engines
        lora_adapter_path=adapter,
    )
    precision = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    if strategy == "fsdp2":
        engine_config = FSDPEngineConfig(
            strategy="fsdp2", use_torch_compile=False, model_dtype="fp32", mixed_precision=precision
        )
    else:
        engine_config = verl_engine.VerlBalanceEngineConfig(mixed_precision=precision)
    engine = EngineRegistry.new(
        model_type="language_model",
        backend=strategy,
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=FSDPOptimizerConfig(lr=1e-2, clip_grad=1e9, total_training_steps=1),
        checkpoint_config=None,
    )
    engine.initialize()
    vocab = model_config.hf_config.vocab_size
    trainable = sorted(n for n, p in engine.module.named_parameters() if p.requires_grad)
    optimizer = getattr(engine, "optimizer", None) or engine.engine.optimizer  # verl's, or our TrainEngine's
    adam_step = record_step(optimizer, engine.module, rename=_adapter_name)
    with engine.train_mode():
        out = engine.train_batch(_tensordict(vocab), loss_function=functools.partial(sft_loss, config=None))
    result = {"loss": float(sum(out["loss"])), "grad_norm": out["metrics"]["grad_norm"], "trainable": trainable}
    result["adam_step"] = adam_step | {"after": trainable_state(engine.module, rename=_adapter_name)}
    for key, kwargs in {
        "base": dict(base_sync_done=False),
        "adapters": dict(base_sync_done=True),
        "adapters_layered": dict(base_sync_done=True, layered_summon=True),
    }.items():
        params, peft_config = engine.get_per_tensor_param(**kwargs)
        result[key] = _numpy(params)
        result[key + "_peft"] = peft_config
    model_config.lora["merge"] = True
    params, peft_config = engine.get_per_tensor_param(base_sync_done=True)
    result["merged"], result["merged_peft"] = _numpy(params), peft_config
    model_config.lora["merge"] = False
    with pytest.raises(ValueError, match="layered_summon"):
        engine.get_per_tensor_param(layered_summon=True, base_sync_done=False)
    for key, ctx in (("log_probs", None), ("ref_log_probs", engine.disable_adapter)):
        with engine.eval_mode(), ctx() if ctx else torch.no_grad():
            infer = engine.infer_batch(_tensordict(vocab), loss_function=None)
        result[key] = [t.detach().double().numpy()[:-1] for t in infer["model_output"]["log_probs"].unbind()]
    return result


@functools.cache
def _runs(model_dir: str, adapter: str) -> dict:
    return {
        strategy: run_on_ranks(
            functools.partial(_lora_engine_run, model_dir=model_dir, adapter=adapter, strategy=strategy), world=1
        )[0]
        for strategy in ("fsdp2", "verl_balance")
    }


def _assert_same_tensors(ours: dict, reference: dict, **tolerance) -> None:
    assert sorted(ours) == sorted(reference)
    for name, value in ours.items():
        assert value.shape == reference[name].shape, name
        np.testing.assert_allclose(value, reference[name], err_msg=name, **tolerance)


def _adapter_name(name: str) -> str:
    """An adapter's name as in peft's adapter file, less its ``base_model.model.`` prefix (no ``.default``)."""
    return name.replace("base_model.model.", "").replace(".default.", ".")


@pytest.mark.slow
def test_lora_train_step_and_weight_sync_equal_verls_fsdp2_engine(model_dir, lora_adapter_dir):
    runs = _runs(model_dir, lora_adapter_dir)
    ours, reference = runs["verl_balance"], runs["fsdp2"]
    assert ours["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    assert ours["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    assert ours["grad_norm"] > 0
    # Only the adapters train, in both (ours without peft's PeftModel prefix).
    assert [n.replace("base_model.model.", "") for n in reference["trainable"]] == ours["trainable"]
    assert all(".lora_" in n for n in ours["trainable"])
    # The same start and gradients, and the one AdamW step those gradients explain (tests/_adam.py).
    assert_same_adam_step(ours["adam_step"], reference["adam_step"])
    # First sync (base_sync_done=False): every base weight, peft's .base_layer names (verl also gives
    # them to the untargeted k_proj / o_proj / gate_proj / up_proj), untouched by training.
    _assert_same_tensors(ours["base"], reference["base"], rtol=0, atol=0)
    assert "model.layers.0.self_attn.q_proj.base_layer.weight" in ours["base"]
    assert not any("lora_" in n for n in ours["base"])
    # Then the adapters alone, under peft's adapter-file keys: each engine's trained adapters exactly;
    # layered_summon gives the same.
    for run in (ours, reference):
        trained = {"base_model.model." + name: param for name, (param, _) in run["adam_step"]["after"].items()}
        _assert_same_tensors(run["adapters"], trained, rtol=0, atol=0)
        _assert_same_tensors(run["adapters_layered"], trained, rtol=0, atol=0)
    assert "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight" in ours["adapters"]
    assert len(ours["adapters"]) == 2 * len(LORA_TARGETS) * 2  # 2 layers of the tiny model
    for key in ("base_peft", "adapters_peft", "adapters_layered_peft"):
        for field in ("r", "lora_alpha", "use_rslora", "use_dora", "bias", "lora_dropout"):
            assert ours[key][field] == reference[key][field], (key, field)
        assert sorted(ours[key]["target_modules"]) == sorted(reference[key]["target_modules"]) == sorted(LORA_TARGETS)
    # model.lora.merge=True: W + alpha/r B @ A under the HF names and no peft config. verl casts its
    # merged weights to bf16 (for vLLM); ours stay fp32: equal within bf16 rounding.
    assert ours["merged_peft"] is None and reference["merged_peft"] is None
    _assert_same_tensors(ours["merged"], reference["merged"], rtol=2**-8, atol=1e-7)
    name = "model.layers.1.self_attn.v_proj.weight"
    delta = np.abs(ours["merged"][name] - ours["base"][name.replace(".weight", ".base_layer.weight")]).max()
    assert delta > 10 * 2**-8 * np.abs(ours["merged"][name]).max()  # the merge is far above bf16 rounding


@pytest.mark.slow
def test_disable_adapter_gives_verls_reference_policy_log_probs(model_dir, lora_adapter_dir):
    runs = _runs(model_dir, lora_adapter_dir)
    ours, reference = runs["verl_balance"], runs["fsdp2"]
    for key in ("log_probs", "ref_log_probs"):
        for got, want in zip(ours[key], reference[key], strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Negative control: the adapters do change the policy (B != 0).
    gap = max(np.abs(a - b).max() for a, b in zip(ours["log_probs"], ours["ref_log_probs"]))
    assert gap > 1e-2


def test_verls_lora_model_keys_reach_our_engine_config_and_unsupported_ones_are_refused():
    from verl.workers.config import HFModelConfig

    from verl_balance.integrations.verl.engine import (
        VerlBalanceEngineConfig,
        VerlBalanceEngineConfigError,
        _our_engine_config,
    )

    class Optim:
        lr, weight_decay, betas, clip_grad = 1e-3, 0.0, (0.9, 0.95), 1.0

    def ours(**model_keys):
        model = HFModelConfig.__new__(HFModelConfig)  # the fields only (no model directory to read)
        for f in HFModelConfig.__dataclass_fields__.values():
            if f.init:
                default = f.default_factory() if callable(f.default_factory) else f.default
                object.__setattr__(model, f.name, default)
        for key, value in model_keys.items():
            object.__setattr__(model, key, value)
        return _our_engine_config(VerlBalanceEngineConfig(), Optim(), model_config=model)

    assert ours().lora_rank == 0  # verl's defaults: LoRA off
    config = ours(lora_rank=16, lora_alpha=32, target_modules=("q_proj", "v_proj"), exclude_modules="^.*mlp.*$")
    assert (config.lora_rank, config.lora_alpha) == (16, 32.0)
    assert config.target_modules == ["q_proj", "v_proj"] and config.exclude_modules == "^.*mlp.*$"
    assert ours(lora_rank=8).target_modules == "all-linear"
    assert ours(lora_rank=8, lora_adapter_path="/x").lora_adapter_path == "/x"
    for keys, match in (
        (dict(lora_rank=8, target_parameters=["experts.w"]), "model.target_parameters"),
        (dict(lora_rank=8, target_modules=None), "model.target_modules"),
        (dict(lora={"rank": 8}), "model.lora.rank"),
        (dict(lora_adapter_path="/x"), "model.lora_adapter_path"),
    ):
        with pytest.raises(VerlBalanceEngineConfigError, match=match):
            ours(**keys)
