"""The verl_balance verl engine backend (``integrations/verl/engine.py``) under verl 0.9.1's own
``BaseEngine`` contract: on a gloo group, ``train_batch`` with verl's ``sft_loss`` at DP2 and SP2
gives the loss and gradient norm of verl's own fsdp2 engine at DP1 on the same model and batch."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from tests._adam import assert_same_adam_step, record_step, trainable_state
from tests._chat import write_chat_parquet
from tests._verl import VERL_SKIP_REASON

pytest.importorskip("verl", reason=VERL_SKIP_REASON)

from tests.integrations.verl_ray_head import runner_env  # noqa: E402
from tests.integrations.verl_sft_ranks import run_verl_sft  # noqa: E402
from verl_balance.distributed.launcher import run_on_ranks  # noqa: E402
from verl_balance.testing.forked_workers import python_command  # noqa: E402

NUM_SAMPLES = 8


def _samples(vocab: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Variable-length samples; the loss mask skips a short prompt (first token always masked)."""
    rng = np.random.default_rng(7)
    out = []
    for length in rng.integers(5, 40, size=NUM_SAMPLES):
        ids = rng.integers(3, vocab, size=int(length))
        mask = np.ones(int(length), dtype=np.int64)
        mask[: int(rng.integers(1, 4))] = 0
        out.append((ids, mask))
    return out


def _tensordict(samples, *, global_batch_size: int, max_token_len_per_gpu: int):
    import torch
    from verl.utils import tensordict_utils as tu

    ids = [torch.as_tensor(s[0]) for s in samples]
    return tu.get_tensordict(
        tensor_dict={
            "input_ids": torch.nested.as_nested_tensor(ids, layout=torch.jagged),
            "position_ids": torch.nested.as_nested_tensor([torch.arange(len(x)) for x in ids], layout=torch.jagged),
            "loss_mask": torch.nested.as_nested_tensor([torch.as_tensor(s[1]) for s in samples], layout=torch.jagged),
        },
        non_tensor_dict={
            "use_remove_padding": False,
            "use_dynamic_bsz": True,
            "max_token_len_per_gpu": max_token_len_per_gpu,
            "micro_batch_size_per_gpu": None,
            "temperature": 1.0,
            "global_batch_size": global_batch_size,
            "pad_mode": "no_padding",
        },
    )


def _plain(metrics: dict) -> dict:
    """The engine's verl_balance metrics as plain numbers (picklable across processes)."""
    return {k: float(v[0]) for k, v in metrics.items() if k.startswith("verl_balance/")}


def _check_balance_metrics(metrics: dict) -> None:
    """Balance figures exist and obey their definitions: sum_j max_d c(d, j) >= max_d sum_j c(d, j),
    and running micro-batches costliest-first on every rank never syncs worse than the planned order."""
    assert metrics["verl_balance/engine_num_micro_batches"] >= 1
    assert metrics["verl_balance/engine_dp_imbalance"] >= 1.0 - 1e-12
    assert 1.0 - 1e-12 <= metrics["verl_balance/engine_sync_ratio"]
    assert metrics["verl_balance/engine_sync_ratio"] <= metrics["verl_balance/engine_planned_order_sync_ratio"] + 1e-12


def _ppo_tensordict(vocab: int, *, loss_agg_mode: str, dp: int, dp_rank: int):
    """verl's PPO actor input for this DP rank: left-padded prompts, right-padded responses,
    ``old_log_probs``/``advantages``, converted by verl's own ``left_right_2_no_padding``."""
    import torch
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    rng = np.random.default_rng(11)
    prompt_width, response_width = 8, 20
    prompt_lens = rng.integers(2, prompt_width + 1, size=NUM_SAMPLES)
    response_lens = rng.integers(1, response_width + 1, size=NUM_SAMPLES)
    prompts = torch.zeros(NUM_SAMPLES, prompt_width, dtype=torch.long)
    responses = torch.zeros(NUM_SAMPLES, response_width, dtype=torch.long)
    attention_mask = torch.zeros(NUM_SAMPLES, prompt_width + response_width, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        prompts[i, prompt_width - p :] = torch.as_tensor(rng.integers(3, vocab, size=p))
        responses[i, :r] = torch.as_tensor(rng.integers(3, vocab, size=r))
        attention_mask[i, prompt_width - p : prompt_width + r] = 1
    response_mask = attention_mask[:, prompt_width:].clone()
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    old_log_probs = torch.as_tensor(rng.normal(-6.0, 0.3, size=(NUM_SAMPLES, response_width)), dtype=torch.float32)
    advantages = torch.as_tensor(rng.normal(0.0, 1.0, size=(NUM_SAMPLES, response_width)), dtype=torch.float32)
    rows = list(range(dp_rank, NUM_SAMPLES, dp))
    data = tu.get_tensordict(
        tensor_dict={
            "input_ids": torch.cat([prompts, responses], 1)[rows],
            "prompts": prompts[rows],
            "responses": responses[rows],
            "attention_mask": attention_mask[rows],
            "response_mask": response_mask[rows],
            "position_ids": position_ids[rows],
            "old_log_probs": old_log_probs[rows] * response_mask[rows],
            "advantages": advantages[rows] * response_mask[rows],
        },
        non_tensor_dict={
            "use_remove_padding": False,
            "use_dynamic_bsz": True,
            "max_token_len_per_gpu": 40,
            "micro_batch_size_per_gpu": None,
            "temperature": 1.0,
            "global_batch_size": NUM_SAMPLES,
            "pad_mode": "no_padding",
            "calculate_entropy": False,
        },
    )
    return left_right_2_no_padding(data)


def _train_one_step(
    rank: int,
    *,
    model_dir: str,
    strategy: str,
    sp: int,
    corrupt_backward_scale: bool = False,
    corrupt_token_count: bool = False,
    checkpoint_dir: str | None = None,
    ppo_loss_agg_mode: str | None = None,
):
    """One verl train_batch on this rank's DP chunk; returns loss, grad_norm (None off verl's output
    ranks, as verl's engines do), metric keys and the log-probs of a following infer_batch."""
    import torch
    import torch.distributed as dist
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.utils.losses import sft_loss

    from verl_balance.integrations.verl import engine as verl_engine
    from verl_balance.integrations.verl.cpu_shims import platform as cpu_platform  # noqa: F401  (importing installs it on CPU)

    model_config = HFModelConfig(
        path=model_dir, use_remove_padding=False, override_config={"attn_implementation": "sdpa"}
    )
    optim = FSDPOptimizerConfig(lr=1e-3, clip_grad=1e9, total_training_steps=1)
    if strategy == "fsdp2":
        engine_config = FSDPEngineConfig(
            strategy="fsdp2",
            use_torch_compile=False,
            model_dtype="fp32",
            mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        )
    else:
        engine_config = verl_engine.VerlBalanceEngineConfig(
            ulysses_sequence_parallel_size=sp, mixed_precision={"param_dtype": "fp32"}
        )

    def new_engine():
        built = EngineRegistry.new(
            model_type="language_model",
            backend=strategy,
            model_config=model_config,
            engine_config=engine_config,
            optimizer_config=optim,
            checkpoint_config=None,
        )
        built.initialize()
        return built

    engine = new_engine()
    # The weights before and after the first AdamW step, and the gradients it took (tests/_adam.py).
    adam_step = record_step(getattr(engine, "optimizer", None) or engine.engine.optimizer, engine.module)
    if corrupt_backward_scale:
        # Negative control: drop the G / dp factor (the SP-scaled gradient bug).
        engine._backward_scale = lambda: 1.0
    if corrupt_token_count:
        # Negative control: normalise by this rank's loss tokens instead of the DP group's.
        engine._global_loss_tokens = lambda data: float(data["loss_mask"].values().sum())
    vocab = model_config.hf_config.vocab_size
    samples = _samples(vocab)
    world = dist.get_world_size()
    dp = world // sp
    dp_rank = rank // sp
    mine = samples[dp_rank::dp]
    data = _tensordict(mine, global_batch_size=len(samples), max_token_len_per_gpu=48)
    loss_fn = functools.partial(sft_loss, config=None)
    if ppo_loss_agg_mode is not None:
        from verl.workers.config import FSDPActorConfig
        from verl.workers.utils.losses import ppo_loss

        actor = FSDPActorConfig(
            strategy="fsdp2",
            rollout_n=1,
            use_dynamic_bsz=True,
            ppo_max_token_len_per_gpu=40,
            ppo_mini_batch_size=NUM_SAMPLES,
            loss_agg_mode=ppo_loss_agg_mode,
        )
        with engine.train_mode():
            out = engine.train_batch(
                _ppo_tensordict(vocab, loss_agg_mode=ppo_loss_agg_mode, dp=dp, dp_rank=dp_rank),
                loss_function=functools.partial(ppo_loss, config=actor),
            )
        # verl's Metric for pg_loss sums its micro-batches (global normalizers); DP ranks are averaged.
        pg_loss = torch.tensor(out["metrics"]["actor/pg_loss"].aggregate(), dtype=torch.float64)
        dist.all_reduce(pg_loss)
        return {
            "pg_loss": pg_loss.item() / world,
            "grad_norm": out["metrics"].get("grad_norm"),
            "metrics": _plain(out["metrics"]),
        }
    with engine.train_mode():
        out = engine.train_batch(data, loss_function=loss_fn)
    # verl's TrainingWorker logs sum(micro-batch losses) averaged over the DP group.
    loss = torch.tensor(float(sum(out["loss"])), dtype=torch.float64)
    dist.all_reduce(loss, op=dist.ReduceOp.SUM)
    loss = loss.item() / world
    with engine.eval_mode():
        infer = engine.infer_batch(
            _tensordict(mine, global_batch_size=len(samples), max_token_len_per_gpu=48), loss_function=None
        )
    log_probs = [t.detach().numpy() for t in infer["model_output"]["log_probs"].unbind()]
    params = {name: t.detach().cpu().double().numpy() for name, t in engine.get_per_tensor_param()[0]}
    result = {"params": params, "adam_step": adam_step | {"after": trainable_state(engine.module)}}
    if checkpoint_dir is not None:
        # Round trip: a fresh engine loaded from the checkpoint takes the same second step.
        engine.save_checkpoint(checkpoint_dir, global_step=1)
        restored = new_engine()
        restored.load_checkpoint(checkpoint_dir)
        second = []
        for e in (engine, restored):
            with e.train_mode():
                again = e.train_batch(
                    _tensordict(mine, global_batch_size=len(samples), max_token_len_per_gpu=48), loss_function=loss_fn
                )
            second.append(
                (sum(again["loss"]), {n: t.detach().cpu().double().numpy() for n, t in e.get_per_tensor_param()[0]})
            )
        result["second_step"] = second
    return result | {
        "loss": loss,
        "grad_norm": out["metrics"].get("grad_norm"),
        "metrics": _plain(out["metrics"]),
        "log_probs": log_probs,
        "dp_rank": dp_rank,
    }


@functools.cache
def _reference(model_dir: str):
    (result,) = run_on_ranks(functools.partial(_train_one_step, model_dir=model_dir, strategy="fsdp2", sp=1), world=1)
    return result


def _ours(model_dir: str, *, world: int, sp: int, **kwargs):
    return run_on_ranks(
        functools.partial(_train_one_step, model_dir=model_dir, strategy="verl_balance", sp=sp, **kwargs), world=world
    )


def _check_log_probs(reference, results, sp: int):
    dp = len(results) // sp
    for r in results:
        expected = [reference["log_probs"][i] for i in range(NUM_SAMPLES)][r["dp_rank"] :: dp]
        assert len(expected) == len(r["log_probs"])
        for got, want in zip(r["log_probs"], expected):
            # verl's last position predicts a token outside the sample: compare the in-sample ones.
            np.testing.assert_allclose(got[:-1], want[:-1], rtol=1e-4, atol=1e-5)


def _check_params(reference, result):
    """The same first AdamW step as verl's engine (the same start and gradients, the step they explain:
    tests/_adam.py), and the weight sync exports the trained weights under the HF names verl's rollout
    sync expects."""
    assert sorted(result["params"]) == sorted(reference["params"])
    assert_same_adam_step(result["adam_step"], reference["adam_step"])
    for run in (result, reference):
        trained = {name: param for name, (param, _) in run["adam_step"]["after"].items()}
        assert set(trained) <= set(run["params"])
        for name, value in run["params"].items():
            if name in trained:
                np.testing.assert_array_equal(value, trained[name], err_msg=name)
            else:  # a tied weight (lm_head.weight = model.embed_tokens.weight): exported under both names
                assert any(np.array_equal(value, t) for t in trained.values()), name


@pytest.mark.slow
def test_dp2_loss_grad_norm_log_probs_and_weights_equal_verls_fsdp2_engine_at_dp1_and_checkpoint_round_trips(
    model_dir, tmp_path
):
    reference = _reference(model_dir)
    results = _ours(model_dir, world=2, sp=1, checkpoint_dir=str(tmp_path / "ckpt"))
    for r in results:
        assert r["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert r["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
        _check_balance_metrics(r["metrics"])
        _check_params(reference, r)
        (loss_kept, params_kept), (loss_restored, params_restored) = r["second_step"]
        assert loss_restored == pytest.approx(loss_kept, rel=1e-6)
        for name, value in params_kept.items():
            np.testing.assert_allclose(params_restored[name], value, rtol=1e-6, atol=1e-7, err_msg=name)
    _check_log_probs(reference, results, sp=1)
    broken = _ours(model_dir, world=2, sp=1, corrupt_token_count=True)
    assert broken[0]["loss"] != pytest.approx(reference["loss"], rel=1e-3)


@pytest.mark.slow
def test_dp2_sp2_loss_grad_norm_and_log_probs_equal_verls_fsdp2_engine_at_dp1(model_dir):
    reference = _reference(model_dir)
    results = _ours(model_dir, world=4, sp=2)
    assert [r["grad_norm"] is not None for r in results] == [True, False, True, False]
    for r in results:
        assert r["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        if r["grad_norm"] is not None:
            assert r["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    _check_params(reference, results[0])
    _check_log_probs(reference, results, sp=2)


@pytest.mark.slow
def test_sp2_loss_and_grad_norm_equal_verls_fsdp2_engine_at_dp1_with_negative_control(model_dir):
    reference = _reference(model_dir)
    results = _ours(model_dir, world=2, sp=2)
    assert [r["grad_norm"] is not None for r in results] == [True, False]  # SP rank 0 reports
    for r in results:
        assert r["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    assert results[0]["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    _check_params(reference, results[0])
    _check_log_probs(reference, results, sp=2)
    # Without the G / dp backward factor the SP gradient is off by sp (the loss is not).
    broken = _ours(model_dir, world=2, sp=2, corrupt_backward_scale=True)
    assert broken[0]["grad_norm"] != pytest.approx(reference["grad_norm"], rel=1e-3)


def test_engine_config_rejects_unknown_workload_naming_the_key():
    from verl_balance.integrations.verl.engine import VerlBalanceEngineConfig, VerlBalanceEngineConfigError

    with pytest.raises(VerlBalanceEngineConfigError, match="engine.workload"):
        VerlBalanceEngineConfig(workload="bytes")
    assert VerlBalanceEngineConfig().strategy == "verl_balance"


def test_verl_entropy_chunking_keys_select_the_chunked_head():
    from verl_balance.engine.config import DEFAULT_LOGITS_CHUNK_SIZE
    from verl_balance.integrations.verl.engine import (
        VerlBalanceEngineConfig,
        VerlBalanceEngineConfigError,
        _our_engine_config,
    )

    assert VerlBalanceEngineConfig().head_chunk_size == DEFAULT_LOGITS_CHUNK_SIZE
    assert VerlBalanceEngineConfig(logits_chunk_size=0).head_chunk_size == 0  # the full-logit path
    for key in ("entropy_from_logits_with_chunking", "entropy_checkpointing"):
        verl_style = VerlBalanceEngineConfig(**{key: True}, entropy_from_logits_chunk_size=300)
        assert verl_style.head_chunk_size == 300
        assert VerlBalanceEngineConfig(**{key: True}, logits_chunk_size=64).head_chunk_size == 64
        with pytest.raises(VerlBalanceEngineConfigError, match="logits_chunk_size=0"):
            VerlBalanceEngineConfig(**{key: True}, logits_chunk_size=0)

    class Optim:
        lr, weight_decay, betas, clip_grad = 1e-3, 0.0, (0.9, 0.95), 1.0

    ours = _our_engine_config(VerlBalanceEngineConfig(entropy_checkpointing=True), Optim())
    assert ours.logits_chunk_size == VerlBalanceEngineConfig().entropy_from_logits_chunk_size


def test_backend_is_registered_for_cpu_and_cuda():
    from verl.workers.engine.base import EngineRegistry

    from verl_balance.integrations.verl.engine import VerlBalanceEngine

    registry = EngineRegistry._engines["language_model"]["verl_balance"]
    assert registry["cpu"] is VerlBalanceEngine and registry["cuda"] is VerlBalanceEngine


@pytest.mark.slow
@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_ppo_loss_dp2_pg_loss_and_grad_norm_equal_verls_fsdp2_engine_at_dp1(model_dir, loss_agg_mode):
    (reference,) = run_on_ranks(
        functools.partial(
            _train_one_step, model_dir=model_dir, strategy="fsdp2", sp=1, ppo_loss_agg_mode=loss_agg_mode
        ),
        world=1,
    )
    results = _ours(model_dir, world=2, sp=1, ppo_loss_agg_mode=loss_agg_mode)
    for r in results:
        assert r["pg_loss"] == pytest.approx(reference["pg_loss"], rel=1e-5)
        assert r["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
        _check_balance_metrics(r["metrics"])


def test_main_ppo_fsdp_engine_config_maps_to_the_backend_config():
    from verl.workers.config import FSDPEngineConfig

    from verl_balance.integrations.verl.engine import VerlBalanceEngineConfigError, as_verl_balance_config

    fsdp = FSDPEngineConfig(strategy="fsdp2", ulysses_sequence_parallel_size=2, seed=3)
    object.__setattr__(fsdp, "strategy", "verl_balance")  # what FSDPActorConfig does with actor.strategy
    ours = as_verl_balance_config(fsdp)
    assert (ours.ulysses_sequence_parallel_size, ours.seed, ours.param_dtype_name) == (2, 3, "bfloat16")  # verl: bf16
    fp32 = FSDPEngineConfig(strategy="fsdp2", mixed_precision={"param_dtype": "fp32"})
    assert as_verl_balance_config(fp32).param_dtype_name == "float32"
    with pytest.raises(VerlBalanceEngineConfigError, match="param_dtype"):
        as_verl_balance_config(FSDPEngineConfig(strategy="fsdp2", mixed_precision={"param_dtype": "fp16"}))
    with pytest.raises(VerlBalanceEngineConfigError, match="offload"):
        as_verl_balance_config(FSDPEngineConfig(strategy="fsdp2", param_offload=True))
    if "grad_offload" in {f.name for f in dataclasses.fields(FSDPEngineConfig)}:  # verl main (0.10.dev) only
        with pytest.raises(VerlBalanceEngineConfigError, match="grad_offload"):
            as_verl_balance_config(FSDPEngineConfig(strategy="fsdp2", grad_offload=True))


# verl's own SFT trainer, unmodified, with torchrun's environment on warm gloo ranks on CPU.


@pytest.fixture(scope="module")
def sft_setup(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("verl_sft")
    write_chat_parquet(root / "train.parquet", rows=32)
    return root, model_dir


# The module's verl SFT trainer runs: {name: _run_sft_trainer keywords}, and the tests that read them.
SFT_RUNS = {
    "fsdp2_dp1": dict(strategy="fsdp2", nproc=1, sp=1),  # the reference of every other run
    "dp2": dict(strategy="verl_balance", nproc=2, sp=1),
    "sp2": dict(strategy="verl_balance", nproc=2, sp=2),
    "dp2xsp2": dict(strategy="verl_balance", nproc=4, sp=2),
    "ray_dp2": dict(strategy="verl_balance", nproc=2, sp=1, on_ray=True),
}
SFT_RUN_TESTS = {
    "test_verls_sft_trainer_with_strategy_verl_balance_matches_fsdp2_at_dp1_for_dp2_sp2_and_dp2xsp2": (
        "dp2",
        "sp2",
        "dp2xsp2",
    ),
    "test_verls_sft_trainer_ray_with_strategy_verl_balance_matches_fsdp2_at_dp1_for_dp2": ("ray_dp2",),
}


@pytest.fixture(scope="module")
def sft_run(sft_setup, request):
    """``sft_run(name)``: the (loss, grad_norm) curve of ``SFT_RUNS[name]``. The Ray run (a subprocess)
    starts on the first call, beside the torchrun-environment runs on the warm ranks (one at a time)."""
    from concurrent.futures import ThreadPoolExecutor

    root, model_dir = sft_setup
    collected = {item.name for item in request.session.items if getattr(item, "module", None) is request.module}
    wanted = ["fsdp2_dp1"] + [name for test, names in SFT_RUN_TESTS.items() if test in collected for name in names]
    in_subprocess = [name for name in wanted if SFT_RUNS[name].get("on_ray")]
    ray_address = request.getfixturevalue("ray_head") if in_subprocess else None
    futures = {}
    with ThreadPoolExecutor(max_workers=1) as pool:

        def result(name: str):
            for other in in_subprocess:
                if other not in futures:
                    kwargs = dict(SFT_RUNS[other], ray_address=ray_address)
                    futures[other] = pool.submit(_run_sft_trainer, root, model_dir, **kwargs)
            if name in futures:
                return futures[name].result()
            return _run_sft_trainer(root, model_dir, **SFT_RUNS[name])

        yield result
        for future in futures.values():
            future.cancel()


@functools.cache  # the fsdp2 reference run serves several tests (sft_run's and the LoRA test's)
def _run_sft_trainer(
    root,
    model_dir: str,
    *,
    strategy: str,
    nproc: int,
    sp: int,
    on_ray: bool = False,
    extra: tuple[str, ...] = (),
    ray_address: str | None = None,
) -> list[tuple[float, float]]:
    """(loss, grad_norm) per step from the console of verl.trainer.sft_trainer with torchrun's environment
    on ``nproc`` warm ranks (``verl_sft_ranks.py``), or of verl.trainer.sft_trainer_ray (a subprocess
    on the session's Ray cluster at ``ray_address``, ``nproc`` Ray workers) when ``on_ray``; ``extra``:
    more Hydra overrides."""
    import re

    run_name = f"ckpt_{strategy}_{nproc}_{sp}_{len(extra)}" + ("_ray" if on_ray else "")  # runs may be concurrent
    target = (
        ["engine._target_=verl_balance.integrations.verl.engine.VerlBalanceEngineConfig"]
        if strategy == "verl_balance"
        else []
    )
    overrides = [
        f"data.train_files={root / 'train.parquet'}",
        "data.train_batch_size=8",
        "data.max_length=256",
        "data.num_workers=0",
        "data.max_token_len_per_gpu=256",
        "data.use_dynamic_bsz=True",
        f"model.path={model_dir}",
        "model.use_remove_padding=False",
        "+model.override_config.attn_implementation=sdpa",
        f"engine.strategy={strategy}",
        f"engine.ulysses_sequence_parallel_size={sp}",
        "engine.use_torch_compile=False",
        "+engine.mixed_precision.param_dtype=fp32",
        *target,
        "optim.lr=1e-3",
        "trainer.device=cpu",
        "trainer.logger=[console]",
        "trainer.total_training_steps=3",
        "trainer.total_epochs=1",
        f"trainer.default_local_dir={root / run_name}",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.resume_mode=disable",
        *extra,
    ]
    if on_ray:
        console = _run_sft_trainer_ray(root, overrides, nproc=nproc, ray_address=ray_address)
    else:
        console = run_verl_sft(overrides, nproc=nproc, cwd=str(root))
    losses = [float(x) for x in re.findall(r"train/loss:([0-9.eE+-]+)", console)]
    norms = [float(x) for x in re.findall(r"train/grad_norm:([0-9.eE+-]+)", console)]
    assert len(losses) == len(norms) == 3, console[-3000:]
    return list(zip(losses, norms))


def _run_sft_trainer_ray(root, overrides: list[str], *, nproc: int, ray_address: str) -> str:
    """The stdout of ``python -m verl.trainer.sft_trainer_ray`` on the session's Ray cluster. Its bare
    ``ray.init()`` takes the workers' variables from the job config Ray reads from the environment
    (``RAY_JOB_CONFIG_JSON_ENV_VAR``, as a Ray job's driver gets them)."""
    import json
    import subprocess

    run_vars = dict(
        VERL_USE_EXTERNAL_MODULES="verl_balance.integrations.verl.cpu_shims.platform,verl_balance.integrations.verl.autopatch"
    )
    job_config = {"runtime_env": {"env_vars": run_vars}}
    env = runner_env(ray_address, RAY_JOB_CONFIG_JSON_ENV_VAR=json.dumps(job_config), **run_vars)
    cmd = python_command(["-m", "verl.trainer.sft_trainer_ray", f"trainer.n_gpus_per_node={nproc}", *overrides])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=str(root))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


@pytest.mark.slow
def test_verls_sft_trainer_with_strategy_verl_balance_matches_fsdp2_at_dp1_for_dp2_sp2_and_dp2xsp2(sft_run):
    reference = sft_run("fsdp2_dp1")
    for name in ("dp2", "sp2", "dp2xsp2"):
        ours = sft_run(name)
        for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(ours, reference), start=1):
            assert loss == pytest.approx(ref_loss, rel=1e-5), (name, step)
            assert norm == pytest.approx(ref_norm, rel=1e-5), (name, step)


@pytest.mark.slow
def test_verls_sft_trainer_ray_with_strategy_verl_balance_matches_fsdp2_at_dp1_for_dp2(sft_run):
    reference = sft_run("fsdp2_dp1")
    ours = sft_run("ray_dp2")
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(ours, reference), start=1):
        assert loss == pytest.approx(ref_loss, rel=1e-5), step
        assert norm == pytest.approx(ref_norm, rel=1e-5), step


@pytest.mark.slow
def test_verls_sft_trainer_with_lora_on_verl_balance_matches_fsdp2_lora_at_dp2_and_sp2(sft_setup, lora_adapter_dir):
    # Both engines start from one peft adapter (model.lora_adapter_path, non-zero B): verl's fsdp2
    # draws fresh adapters from torch's global RNG, ours from (seed, name), so only a shared starting
    # adapter makes the runs comparable. Only the adapters train (3 steps, lr 1e-3).
    root, model_dir = sft_setup
    lora = ("model.lora_rank=8", f"model.lora_adapter_path={lora_adapter_dir}")
    reference = _run_sft_trainer(root, model_dir, strategy="fsdp2", nproc=1, sp=1, extra=lora)
    full = _run_sft_trainer(root, model_dir, strategy="fsdp2", nproc=1, sp=1)  # cached: the tests above
    for nproc, sp in ((2, 1), (2, 2)):
        ours = _run_sft_trainer(root, model_dir, strategy="verl_balance", nproc=nproc, sp=sp, extra=lora)
        for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(ours, reference), start=1):
            assert loss == pytest.approx(ref_loss, rel=1e-5), (nproc, sp, step)
            assert norm == pytest.approx(ref_norm, rel=1e-5), (nproc, sp, step)
    # Negative control: the LoRA runs are not the full fine-tuning run, by 10x the tolerance above
    # (step 1: the adapter changes the loss by ~1e-3 relative; only the adapters' gradients count).
    assert reference[0][0] != pytest.approx(full[0][0], rel=1e-4)
    assert reference[0][1] != pytest.approx(full[0][1], rel=1e-4)
