"""verl_balance.memory: exact parameter counts and sharded state bytes, the estimate's hand-worked
terms, and the CLI.

References: the published parameter counts of the named sizes; the real transformers modules
built from the same config (on the meta device, names and shapes); hand-worked shard sizes; and
the live tensors of a TrainEngine on 1, 2 and 3 gloo ranks (slow).
"""

from __future__ import annotations

import functools
import math
import subprocess
import sys

import pytest

from verl_balance.memory import (
    NAMED_SIZES,
    MemoryLayout,
    MemoryModelError,
    ModelShapes,
    activation_bytes_per_token,
    estimate,
    load_shapes,
    main,
    shapes_from_hf_config,
    state_bytes,
)

# Published totals (Hugging Face model cards / safetensors metadata).
PUBLISHED_PARAMS = {
    "qwen2.5-0.5b": 494_032_768,  # "0.49B", tied embeddings counted once
    "qwen2.5-7b": 7_615_616_512,  # "7.61B"
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "mixtral-8x7b": 46_702_792_704,
}
# Hugging Face's "Model size" (from the safetensors metadata), rounded to 0.1B.
PUBLISHED_ROUNDED = {"qwen2.5-14b": 14.8e9, "qwen2.5-32b": 32.8e9, "qwen2.5-72b": 72.7e9, "qwen3-30b-a3b": 30.5e9}

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4)
# One config per family and per shape feature the counter models (GQA, biases, qk norms, extra
# norms, fused MoE experts, sparse-step / mlp-only layers, shared expert, tied / untied).
TINY_FAMILIES = {
    "llama": dict(model_type="llama", num_key_value_heads=2, tie_word_embeddings=False),
    "llama_bias": dict(model_type="llama", num_key_value_heads=1, attention_bias=True, mlp_bias=True),
    "mistral": dict(model_type="mistral", num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2_tied": dict(model_type="qwen2", num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
    "gemma": dict(model_type="gemma", num_key_value_heads=1, head_dim=16),
    "gemma2": dict(model_type="gemma2", num_key_value_heads=2, head_dim=16),
    "gemma3_text": dict(model_type="gemma3_text", num_key_value_heads=2, head_dim=16),
    "mixtral": dict(model_type="mixtral", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        decoder_sparse_step=2,
        mlp_only_layers=[2],
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
    ),
}


def _hf_meta_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """name -> shape of every parameter of the real transformers model (meta device, no memory)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    kw = {k: v for k, v in cfg.items() if k != "model_type"}
    config = transformers.AutoConfig.for_model(cfg["model_type"], **kw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_named_size_param_count_equals_published(name):
    assert load_shapes(name).num_params == PUBLISHED_PARAMS[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED_ROUNDED))
def test_named_size_param_count_rounds_to_published(name):
    assert load_shapes(name).num_params == pytest.approx(PUBLISHED_ROUNDED[name], abs=0.05e9)


def test_moe_active_params_hold_only_k_of_e_experts():
    # Mixtral 8x7B: "12.9B active"; Qwen3-30B-A3B: "3.3B activated".
    assert load_shapes("mixtral-8x7b").num_active_params == pytest.approx(12.9e9, rel=0.01)
    assert load_shapes("qwen3-30b-a3b").num_active_params == pytest.approx(3.3e9, rel=0.02)
    dense = load_shapes("qwen2.5-7b")
    assert dense.num_active_params == dense.num_params


@pytest.mark.parametrize("variant", sorted(TINY_FAMILIES))
def test_tensor_shapes_equal_transformers_modules(variant):
    cfg = {**TINY, **TINY_FAMILIES[variant]}
    expected = _hf_meta_shapes(cfg)
    ours = shapes_from_hf_config(cfg)
    assert dict(ours.tensors()) == expected
    assert ours.num_params == sum(math.prod(s) for s in expected.values())


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen2.5-7b", "mixtral-8x7b", "qwen3-30b-a3b"])
def test_named_size_shapes_equal_transformers_modules(name):
    assert dict(load_shapes(name).tensors()) == _hf_meta_shapes(NAMED_SIZES[name])


def test_model_dir_count_equals_loaded_model(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from verl_balance.models.tiny_hf import write_tiny_model

    path = write_tiny_model(str(tmp_path / "qwen2"), family="qwen2")  # tied embeddings
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert load_shapes(path).num_params == sum(p.numel() for p in model.parameters())
    assert load_shapes(path + "/config.json").num_params == sum(p.numel() for p in model.parameters())


def _odd_shapes() -> ModelShapes:
    return ModelShapes(
        name="odd",
        family="builtin",
        vocab_size=5,
        hidden_size=3,
        num_heads=1,
        num_kv_heads=1,
        head_dim=3,
        intermediate_size=3,
        root=(("embed", (5, 3)), ("norm", (3,))),
        layers=((("w", (4, 3)),),),
    )


def test_sharded_state_bytes_hand_worked():
    # W = 2: rows of a dim of 5 split 3 + 2, of 3 split 2 + 1, of 4 split 2 + 2.
    # rank 0: 3*3 + 2 + 2*3 = 17 elements; rank 1: 2*3 + 1 + 2*3 = 13; 3 tensors -> 3 step scalars.
    layout = MemoryLayout(dp=2, sp=1)
    assert state_bytes(_odd_shapes(), layout, rank=0) == {"params": 68, "grads": 68, "optimizer": 2 * 68 + 12}
    assert state_bytes(_odd_shapes(), layout, rank=1) == {"params": 52, "grads": 52, "optimizer": 2 * 52 + 12}
    # W = 4 (dp=2, sp=2): chunks of ceil(d0/4): 5 -> 2,2,1,0; 3 -> 1,1,1,0; 4 -> 1,1,1,1.
    layout = MemoryLayout(dp=2, sp=2)
    per_rank = [state_bytes(_odd_shapes(), layout, rank=r)["params"] // 4 for r in range(4)]
    assert per_rank == [2 * 3 + 1 + 3, 2 * 3 + 1 + 3, 3 + 1 + 3, 0 + 0 + 3]
    assert sum(per_rank) == _odd_shapes().num_params


def test_activation_bytes_per_token_hand_worked():
    # preset tiny (h=32, 4 heads of 8, 2 kv heads, I=64), bf16: each RMSNorm (4 + 2) * 32 = 192;
    # attention 192 + 2 * (3 * 32 + 2 * 16) + 4 * 4 = 464; MLP 192 + 4 * 2 * 64 = 704.
    assert activation_bytes_per_token(load_shapes("preset:tiny"), layer=0, dtype_bytes=2) == 464 + 704


def test_checkpointing_and_head_chunk_shrink_their_terms():
    shapes = load_shapes("qwen2.5-7b")
    base = estimate(shapes, MemoryLayout(dp=8, tokens=16384))
    ac = estimate(shapes, MemoryLayout(dp=8, tokens=16384, activation_checkpointing=True))
    chunked = estimate(shapes, MemoryLayout(dp=8, tokens=16384, head_chunk=1024))
    h, layers, t = shapes.hidden_size, shapes.num_layers, 16384
    assert ac.activations == t * (2 * h * layers + 6 * h) and ac.recompute == t * base.per_token_layer
    # The recompute of a layer follows the head's backward: the peak holds the larger of the two.
    assert ac.step_transient == ac.unsharded_params + ac.unsharded_grads + ac.activations + max(ac.head, ac.recompute)
    assert base.recompute == 0
    assert base.head == t * 152064 * 14 and chunked.head == 1024 * 152064 * 14
    assert chunked.activations == base.activations and ac.head == base.head
    # One fp32 rank runs the plain module: nothing is all-gathered.
    single = estimate(shapes, MemoryLayout(dp=1, param_dtype="float32", tokens=16))
    assert single.unsharded_params == single.unsharded_grads == 0
    assert single.params == 4 * shapes.num_params


# ------------------------------------------------------------------------------------------ CLI
def test_cli_on_named_size(capsys):
    assert main(["qwen2.5-7b", "--gpus", "8", "--sp", "2", "--tokens", "8192", "--ac", "--gpu-mem", "80"]) == 0
    out = capsys.readouterr().out
    assert "7,615,616,512 parameters" in out and "dp=4 sp=2 (W=8)" in out
    assert "fits in 80 GiB with 10% headroom (72.0 GiB usable): yes" in out


@pytest.mark.slow  # a second interpreter
def test_cli_on_model_dir_as_module(tmp_path):
    from verl_balance.models.tiny_hf import write_tiny_model

    path = write_tiny_model(str(tmp_path / "llama"), family="llama")
    out = subprocess.run(
        [sys.executable, "-m", "verl_balance.memory", path, "--dp", "2", "--tokens", "64"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert f"{load_shapes(path).num_params:,} parameters" in out and "total (step peak)" in out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["qwen9-1b"], "MODEL: 'qwen9-1b' is neither a named size"),
        (["qwen2.5-7b", "--gpus", "8", "--sp", "3"], "--sp: sp=3 does not divide gpus=8"),
        (["qwen2.5-7b", "--gpus", "8", "--dp", "3", "--sp", "2"], "--dp: dp=3 x sp=2 = 6 ranks, but gpus=8"),
        (["qwen2.5-7b", "--sp", "8"], "--sp: sp=8 must divide num_heads=28"),
        (["qwen2.5-0.5b", "--sp", "7"], "--sp: sp=7 must divide num_kv_heads=2"),
        (["qwen2.5-7b", "--tokens", "0"], "--tokens: tokens=0 must be a positive int"),
    ],
)
def test_cli_bad_input_names_the_argument(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_unknown_preset_and_family_are_errors(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(MemoryModelError, match="not a readable JSON config"):
        load_shapes(str(tmp_path))
    with pytest.raises(MemoryModelError, match="nor a model directory with config.json"):
        load_shapes(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    with pytest.raises(MemoryModelError, match="lacks 'num_attention_heads'"):
        load_shapes(str(tmp_path))
    with pytest.raises(MemoryModelError, match="unknown built-in preset 'huge'"):
        load_shapes("preset:huge")
    with pytest.raises(MemoryModelError, match="model_type='bert' is not supported"):
        shapes_from_hf_config({"model_type": "bert"})


# ------------------------------------------------------------------------ live engine (slow)
def _engine_state(rank: int, *, model: str, dp: int, sp: int, param_dtype: str) -> dict:
    """One training step on this rank; the local bytes of its gradients (before the optimizer) and
    of its parameters and optimizer state (after)."""
    import torch

    from verl_balance.distributed import ParallelLayout
    from verl_balance.engine import EngineConfig, TrainEngine
    from verl_balance.models import ModelConfig
    from verl_balance.models.hf import HFModelConfig
    from verl_balance.testing.memory_probe import local_state_bytes

    if model.startswith("preset:"):
        model_config = ModelConfig.preset(model.split(":", 1)[1])
    else:
        model_config = HFModelConfig.from_pretrained(model)
    engine = TrainEngine(
        model_config=model_config,
        engine_config=EngineConfig(param_dtype=param_dtype),
        layout=ParallelLayout(dp=dp, sp=sp, device_type="cpu"),
    )
    gen = torch.Generator().manual_seed(rank // sp)
    ids = torch.randint(0, 100, (2, 16), generator=gen)
    mb = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones(2, 16)}
    engine.zero_grad()
    (packed,) = engine.pack_micro_batches([mb], require_loss_mask=True)
    engine.prepare_backward(is_last=True)
    logits = engine.forward_logits(packed)
    logits.float().logsumexp(-1).sum().backward()
    grads = local_state_bytes(engine.model, engine.optimizer)["grads"]
    engine.optimizer_step()
    return {**local_state_bytes(engine.model, engine.optimizer), "grads": grads}


LIVE_CASES = [
    # (model, dp, sp, param_dtype): unsharded fp32, 1-rank FSDP2 bf16, uneven 3-way shards, SP + tied HF.
    ("preset:tiny", 1, 1, "float32"),
    ("preset:tiny", 1, 1, "bfloat16"),
    ("preset:tiny", 3, 1, "bfloat16"),
    ("hf:qwen2", 1, 2, "bfloat16"),
]


@pytest.mark.slow
@pytest.mark.parametrize("model, dp, sp, param_dtype", LIVE_CASES)
def test_live_engine_state_bytes_equal_prediction(model, dp, sp, param_dtype, tmp_path):
    from verl_balance.distributed.launcher import run_on_ranks

    if model.startswith("hf:"):
        from verl_balance.models.tiny_hf import write_tiny_model

        model = write_tiny_model(str(tmp_path / "m"), family=model[3:])  # tied embeddings, vocab 384
    fn = functools.partial(_engine_state, model=model, dp=dp, sp=sp, param_dtype=param_dtype)
    measured = run_on_ranks(fn, world=dp * sp)
    shapes, layout = load_shapes(model), MemoryLayout(dp=dp, sp=sp, param_dtype=param_dtype)
    predicted = [state_bytes(shapes, layout, rank=r) for r in range(dp * sp)]
    assert measured == predicted
    if dp * sp == 3:
        # Negative control: an even split (P / W per rank) is not what FSDP2 holds on 3 ranks.
        even = 4 * shapes.num_params / 3
        assert any(m["params"] != even for m in measured)
