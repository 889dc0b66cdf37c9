"""verl 0.9.1's own ``python -m verl.trainer.main_ppo`` runs GRPO end to end on CPU with the
``verl_balance_cpu`` rollout (``verl_balance.integrations.verl.cpu_shims.rollout``), for
``actor_rollout_ref.actor.strategy=verl_balance`` and for verl's ``fsdp2``.

Everything is verl's, unmodified: the Hydra entry point, ``RayPPOTrainer.fit`` (``trainer.use_v1=False``,
and verl's default v1 trainer in one more run when TransferQueue is installed), the agent loop, the
reward loop, the naive (hybrid) checkpoint engine. Only the platform (``cpu_platform``), the rollout server
(``cpu_rollout``) and, for ``strategy=verl_balance``, the training engine are ours.

Step 1's rollout comes from the same initial weights and the same per-request sampling seeds
(``rollout.full_determinism=True``), so both backends train on the same samples and must log the same
``actor/pg_loss`` and ``actor/grad_norm``. Step 2's rollout comes from each backend's own updated
weights; the rollout's log-probabilities then equal the trainer's recomputed ones only if the update
reached the rollout server (negative control: a rollout that keeps its first weights, in the v1
trainer's run, whose checks hold for any samples). A third run (``verl_balance`` with our trainer-side
balancer and one rollout replica for both workers) gives step 1 of the plain run, which has two
replicas: samples do not depend on routing, the loss not on the row placement. Only the plain run
has two replicas; every other run has one (a rollout server process less per run).

Five main_ppo subprocesses (about 30 s each on 2 CPU cores) are ``slow``; they share one Ray cluster
(``ray_head``, started once per session, conftest.py) instead of starting one each; the rollout server's pieces
(decode against HF ``generate`` and an uncached sampler, seeds, weight loading, registration) are
tested in this process in the fast lane.
"""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest

from tests._verl import VERL_SKIP_REASON, no_worse_than_naive
from tests.integrations.verl_ray_head import cluster_env
from verl_balance.testing.forked_workers import python_command

pytest.importorskip("verl", reason=VERL_SKIP_REASON)
pytest.importorskip("pyarrow", reason="writing the parquet data set needs pyarrow")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
EXTERNAL_MODULES = "verl_balance.integrations.verl.cpu_shims.platform,verl_balance.integrations.verl.cpu_shims.rollout"
STALE_ROLLOUT = "verl_main_ppo_stale_rollout"  # negative control (this folder)
AUTOPATCH = "verl_balance.integrations.verl.autopatch"
NUM_PROMPTS = 8
TRAIN_BATCH_SIZE = 4  # prompts per step: 2 steps in one epoch
ROLLOUT_N = 2
STEPS = 2
TWO_REPLICAS = "actor_rollout_ref.rollout.tensor_model_parallel_size=1"  # one replica (server) per trainer worker
# LoRA on our backend (rank 8 on every Linear, fresh adapters: B = 0). verl then computes the reference
# policy in the actor with the adapters disabled (ref_in_actor); use_kl_loss makes it do so. lr 1e-2:
# the step-1 update moves the policy clearly away from the base.
LORA = (
    "actor_rollout_ref.model.lora_rank=8",
    "actor_rollout_ref.model.lora_alpha=16",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.optim.lr=1e-2",
)


def write_gsm8k_like_parquet(path: str, *, num_prompts: int) -> None:
    """verl's RL data format (as ``examples/data_preprocess/gsm8k.py`` writes it): chat ``prompt``,
    ``data_source``, ``ability``, ``reward_model.ground_truth``, ``extra_info``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for i in range(num_prompts):
        a, b = 3 + 7 * i, 11 + 5 * i
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"what is {a}+{b}? the answer is"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": "train", "index": i},
            }
        )
    pq.write_table(pa.Table.from_pylist(rows), path)


def add_stop_tokens(model_dir: str, *, every: int = 12) -> list[int]:
    """List every ``every``-th token id as an extra eos in ``generation_config.json`` (real chat
    models list several). A random model almost never samples ``<|im_end|>``, so without this every
    response would run to the length limit; with equal lengths the first GRPO step's ``pg_loss`` is
    exactly 0 (each group's advantages sum to 0), and comparing it would compare rounding noise."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = GenerationConfig.from_pretrained(model_dir)
    config.eos_token_id = [tokenizer.eos_token_id, *range(every, len(tokenizer), every)]
    config.save_pretrained(model_dir)
    return config.eos_token_id


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tiny Qwen2 model (with a ChatML tokenizer) and a GSM8K-shaped parquet file."""
    from verl_balance.models.tiny_hf import write_tiny_model

    root = tmp_path_factory.mktemp("verl_main_ppo")
    model_dir = str(root / "tiny_qwen2")
    write_tiny_model(model_dir, family="qwen2")
    add_stop_tokens(model_dir)
    data = str(root / "train.parquet")
    write_gsm8k_like_parquet(data, num_prompts=NUM_PROMPTS)
    return {"root": str(root), "model_dir": model_dir, "data": data}


@pytest.fixture(scope="module")
def cluster_workspace(workspace, ray_head):
    """``workspace`` and the address of the session's Ray cluster: what ``run_main_ppo`` needs."""
    return workspace | {"ray_address": ray_head}


def main_ppo_overrides(*, model_dir: str, data: str, strategy: str, out_dir: str) -> list[str]:
    """Hydra overrides for a 2-step GRPO run on 2 CPU workers with the ``verl_balance_cpu`` rollout."""
    actor = "actor_rollout_ref.actor"
    rollout = "actor_rollout_ref.rollout"
    overrides = [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={data}",
        f"data.val_files={data}",
        f"data.train_batch_size={TRAIN_BATCH_SIZE}",
        "data.max_prompt_length=48",  # the chat-templated prompts have 36 tokens: none is truncated
        "data.max_response_length=16",
        "data.shuffle=False",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.use_remove_padding=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"{actor}.strategy={strategy}",
        f"{actor}.ppo_mini_batch_size={TRAIN_BATCH_SIZE}",  # one optimizer step per training step
        f"{actor}.use_dynamic_bsz=True",
        f"{actor}.ppo_max_token_len_per_gpu=128",
        f"{actor}.use_torch_compile=False",
        f"{actor}.fsdp_config.use_torch_compile=False",
        f"+{actor}.fsdp_config.mixed_precision.param_dtype=fp32",
        f"+{actor}.fsdp_config.mixed_precision.reduce_dtype=fp32",
        f"+{actor}.fsdp_config.mixed_precision.buffer_dtype=fp32",
        f"{actor}.optim.lr=1e-3",
        f"{rollout}.name=verl_balance_cpu",
        f"{rollout}.n={ROLLOUT_N}",
        f"{rollout}.dtype=float32",
        # One replica (one server process) for both trainer workers; the plain verl_balance run has two
        # (TWO_REPLICAS), the replica-count side of the routing comparison.
        f"{rollout}.tensor_model_parallel_size=2",
        f"{rollout}.full_determinism=True",  # request ids = sample indices: the same samples in both runs
        f"{rollout}.agent.num_workers=1",
        f"{rollout}.log_prob_use_dynamic_bsz=True",
        f"{rollout}.log_prob_max_token_len_per_gpu=128",
        "reward.num_workers=1",
        f"reward.custom_reward_function.path={os.path.join(HERE, 'verl_main_ppo_reward.py')}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.use_v1=False",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=2",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={STEPS}",
        "trainer.total_epochs=1",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        "trainer.logger=[console,file]",
        f"trainer.default_local_dir={out_dir}/checkpoints",
        "trainer.project_name=verl_balance_cpu_rollout",
        f"trainer.experiment_name={strategy}",
        # The session's Ray cluster (``ray_head``) gives the resources: connecting to it, ray.init
        # takes no resource counts.
        "ray_kwargs.ray_init.num_cpus=null",
    ]
    if strategy == "verl_balance":
        overrides.append("actor_rollout_ref.model.external_lib=verl_balance.integrations.verl.engine")
    return overrides


def run_main_ppo(
    workspace: dict, *, strategy: str, name: str, extra_modules: str = "", extra_overrides: tuple[str, ...] = ()
) -> dict:
    """Run ``python -m verl.trainer.main_ppo``; {"steps": {step: metrics}, "console": [lines], "log": tail}.

    ``extra_overrides`` replace the defaults of ``main_ppo_overrides`` with the same key."""
    out_dir = os.path.join(workspace["root"], name)
    os.makedirs(out_dir, exist_ok=True)
    metrics_file = os.path.join(out_dir, "metrics.jsonl")
    # Per-run variables reach the cluster's workers through verl's runtime_env (the cluster's raylet
    # has only the shared ones, ``cluster_env``); the driver reads them from its own environment.
    run_vars = {
        "VERL_USE_EXTERNAL_MODULES": EXTERNAL_MODULES + (f",{extra_modules}" if extra_modules else ""),
        "VERL_FILE_LOGGER_PATH": metrics_file,
    }
    env = dict(cluster_env(), **run_vars)
    env.pop("RAY_ADDRESS", None)  # the address comes in ray_kwargs.ray_init.address
    overrides = main_ppo_overrides(
        model_dir=workspace["model_dir"], data=workspace["data"], strategy=strategy, out_dir=out_dir
    )
    overrides += [f'+ray_kwargs.ray_init.address="{workspace["ray_address"]}"']
    overrides += [f'+ray_kwargs.ray_init.runtime_env.env_vars.{k}="{v}"' for k, v in run_vars.items()]
    replaced = {override.split("=")[0] for override in extra_overrides}
    overrides = [o for o in overrides if o.split("=")[0] not in replaced] + list(extra_overrides)
    proc = subprocess.run(
        python_command(["-m", "verl.trainer.main_ppo", *overrides]),
        env=env,
        cwd=out_dir,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-8000:]
    with open(metrics_file) as f:
        records = [json.loads(line) for line in f if line.strip()]
    steps = {int(r["step"]): r["data"] for r in records}
    console = [line for line in proc.stdout.splitlines() if "step:" in line and "actor/pg_loss:" in line]
    return {"steps": steps, "console": console, "log": log[-8000:]}


@pytest.fixture(scope="module")
def runs(cluster_workspace):
    """One main_ppo run per backend (on the session's Ray cluster), plus ``verl_balance`` with our
    trainer-side balancer (``autopatch``). The plain ``verl_balance`` run has two rollout replicas
    (one per trainer worker), the others one replica for both workers (one server process less)."""
    workspace = cluster_workspace
    return {
        "verl_balance": run_main_ppo(
            workspace, strategy="verl_balance", name="verl_balance", extra_overrides=(TWO_REPLICAS,)
        ),
        "fsdp2": run_main_ppo(workspace, strategy="fsdp2", name="fsdp2"),
        "verl_balance_autopatch_one_replica": run_main_ppo(
            workspace, strategy="verl_balance", name="verl_balance_autopatch_one_replica", extra_modules=AUTOPATCH
        ),
    }


@pytest.fixture(scope="module")
def v1_stale_run(cluster_workspace):
    """verl's default v1 trainer (``trainer.use_v1=True``) with our engine and autopatch, on a rollout
    server that keeps its first weights (``STALE_ROLLOUT``): one run for two tests. Its checks of the
    trainer hold for any samples; the stale server is the negative control of the weight sync.

    verl's v1 agent loop gives every sample of a prompt the request id "det-0" under
    full_determinism, so per-request seeds would make a group's n samples identical (all GRPO
    advantages 0): this run samples with fresh seeds."""
    pytest.importorskip("transfer_queue", reason="verl's v1 trainer needs TransferQueue (in the verl extra)")
    return run_main_ppo(
        cluster_workspace,
        strategy="verl_balance",
        name="verl_balance_v1_stale_rollout",
        extra_modules=f"{AUTOPATCH},{STALE_ROLLOUT}",
        extra_overrides=(
            "trainer.use_v1=True",
            "actor_rollout_ref.rollout.full_determinism=False",
            # one TransferQueue storage actor instead of verl's 8 (a process each) for 16 samples a step
            "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        ),
    )


@pytest.fixture(scope="module")
def lora_run(cluster_workspace):
    """``verl_balance`` with LoRA (``LORA``), on the same workspace."""
    return run_main_ppo(cluster_workspace, strategy="verl_balance", name="verl_balance_lora", extra_overrides=LORA)


def _finite(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["verl_balance", "fsdp2"])
def test_main_ppo_trains_two_grpo_steps_with_the_cpu_rollout(runs, strategy):
    run = runs[strategy]
    assert sorted(run["steps"]) == list(range(1, STEPS + 1)), run["log"]
    assert len(run["console"]) == STEPS, run["log"]  # verl's console logger printed each step
    for step, metrics in run["steps"].items():
        assert _finite(metrics["actor/pg_loss"]), (step, metrics)
        assert _finite(metrics["actor/grad_norm"]) and metrics["actor/grad_norm"] > 0, (step, metrics)
        # The rollout answered every prompt n times with at least one token, and the rewards vary.
        assert metrics["response_length/min"] >= 1, metrics
        assert metrics["critic/score/max"] > metrics["critic/score/min"], metrics
        # Responses end at a stop token or at the length limit (16): lengths vary, so pg_loss is not 0.
        assert metrics["response_length/min"] < metrics["response_length/max"], metrics
    # Our engine's balance metrics, and only with our engine.
    ours = {k for k in run["steps"][1] if k.startswith("actor/verl_balance/")}
    if strategy == "verl_balance":
        assert ours and all(_finite(run["steps"][1][k]) for k in ours), run["steps"][1]
    else:
        assert not ours


@pytest.mark.slow
def test_step_one_pg_loss_and_grad_norm_equal_between_verl_balance_and_fsdp2(runs):
    ours, reference = runs["verl_balance"]["steps"][1], runs["fsdp2"]["steps"][1]
    # The same samples and rewards reached both trainers (same weights, same per-request seeds) ...
    for key in ("response_length/mean", "response_length/max", "critic/score/mean", "critic/advantages/max"):
        assert ours[key] == pytest.approx(reference[key], rel=1e-6), key
    # ... and the PPO step on them agrees.
    assert ours["actor/pg_loss"] == pytest.approx(reference["actor/pg_loss"], rel=1e-4)
    assert ours["actor/grad_norm"] == pytest.approx(reference["actor/grad_norm"], rel=1e-4)
    # Not a trivial agreement: the step moved the policy (step 2's gradient is another one).
    assert reference["actor/grad_norm"] != pytest.approx(runs["fsdp2"]["steps"][2]["actor/grad_norm"], rel=1e-3)


@pytest.mark.slow
def test_samples_and_step_one_do_not_depend_on_rollout_replicas_or_the_trainer_side_balancer(runs):
    # Two replicas (tp=1) vs one replica serving both workers (tp=2): per-request seeds make the samples
    # independent of routing. The autopatched partition places rows on other ranks: the same loss.
    ours, reference = runs["verl_balance_autopatch_one_replica"]["steps"][1], runs["verl_balance"]["steps"][1]
    for key in ("response_length/mean", "response_length/max", "critic/score/mean", "critic/advantages/max"):
        assert ours[key] == pytest.approx(reference[key], rel=1e-6), key  # means over reordered rows
    assert ours["actor/pg_loss"] == pytest.approx(reference["actor/pg_loss"], rel=1e-5)
    assert ours["actor/grad_norm"] == pytest.approx(reference["actor/grad_norm"], rel=1e-5)
    for metrics in runs["verl_balance_autopatch_one_replica"]["steps"].values():
        # Our balancer ran inside verl's _balance_batch and logged its metrics (not in the plain runs).
        assert no_worse_than_naive(metrics), metrics
    assert "verl_balance/imbalance" not in reference


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["verl_balance", "fsdp2", "verl_balance_autopatch_one_replica"])
def test_rollout_log_probs_equal_the_trainers_at_every_step_so_weights_reached_the_rollout(runs, strategy):
    # verl compares the rollout's token probabilities with the trainer's recomputed old_log_probs:
    # after step 1's update they agree only if update_weights pushed the new weights to the server.
    for step, metrics in runs[strategy]["steps"].items():
        assert metrics["training/rollout_probs_diff_valid"] == 1
        assert metrics["training/rollout_probs_diff_max"] < 1e-4, (step, metrics["training/rollout_probs_diff_max"])


@pytest.mark.slow
def test_main_ppo_with_lora_on_verl_balance_trains_the_adapters_and_the_rollout_follows(lora_run):
    # verl's LoRA weight sync on our backend: the base weights once (load_format=dummy), then the
    # adapters at every step, merged by the CPU rollout.
    run = lora_run
    assert sorted(run["steps"]) == list(range(1, STEPS + 1)), run["log"]
    first, second = run["steps"][1], run["steps"][2]
    for metrics in (first, second):
        assert _finite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0, metrics
        assert _finite(metrics["actor/verl_balance/engine_dp_imbalance"]), metrics
        # The rollout's log-probs equal the trainer's as closely as without LoRA (the test above).
        assert metrics["training/rollout_probs_diff_valid"] == 1
        assert metrics["training/rollout_probs_diff_max"] < 1e-4, metrics["training/rollout_probs_diff_max"]
    # The reference policy is the actor with its adapters disabled: equal to the policy before the
    # first update (B = 0), apart after it. So the step-2 policy the rollout matched is not the base.
    assert first["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)
    assert second["actor/kl_loss"] > 1e-3


@pytest.mark.slow
def test_a_rollout_that_keeps_its_first_weights_is_detected(v1_stale_run, runs):
    # Negative control: a run whose server ignores every weight update after the first. It is the v1
    # trainer's run (below): verl's synchronous v1 trainer updates the (colocated) rollout after
    # every step and computes the same rollout-vs-trainer log-prob metric (calculate_log_probs).
    first, second = v1_stale_run["steps"][1], v1_stale_run["steps"][2]
    assert first["training/rollout_probs_diff_max"] < 1e-4  # step 1 still uses the initial weights
    synced = runs["fsdp2"]["steps"][2]["training/rollout_probs_diff_max"]
    assert second["training/rollout_probs_diff_max"] > 100 * synced
    assert second["training/rollout_probs_diff_max"] > 1e-3


@pytest.mark.slow
def test_verls_default_v1_trainer_runs_grpo_with_the_engine_and_autopatch(v1_stale_run):
    # verl's default trainer (trainer.use_v1=true: replay buffer and agent loop over TransferQueue), with
    # our engine and our _balance_batch for that trainer. What is checked holds for any samples (the
    # run's rollout keeps its first weights: the negative control above).
    run = v1_stale_run
    assert sorted(run["steps"]) == list(range(1, STEPS + 1)), run["log"]
    for step, metrics in run["steps"].items():
        assert _finite(metrics["actor/pg_loss"]), (step, metrics)
        assert _finite(metrics["actor/grad_norm"]) and metrics["actor/grad_norm"] > 0, (step, metrics)
        assert metrics["critic/advantages/max"] > metrics["critic/advantages/min"], (step, metrics)
        # The patched v1 _balance_batch ran, and our engine planned the micro-batches.
        assert no_worse_than_naive(metrics), (step, metrics)
        assert _finite(metrics["actor/verl_balance/engine_dp_imbalance"]), (step, metrics)


# ---------------------------------------------------------------------------------------------
# The rollout server's pieces, in this process (fast lane): decode, sampling, weights, registry.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_rollout():
    from verl_balance.integrations.verl.cpu_shims import rollout as cpu_rollout

    return cpu_rollout


@pytest.fixture(scope="module")
def tiny_lm(workspace):
    """(model, tokenizer, prompt ids, stop ids) of the tiny Qwen2 in fp32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(workspace["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(workspace["model_dir"], dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "what is 3+11? the answer is"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    stops = GenerationConfig.from_pretrained(workspace["model_dir"]).eos_token_id
    return model, tokenizer, prompt_ids, stops


def make_server(cpu_rollout, model_dir: str, *, load_format: str = "auto", seed: int = 7):
    """A ``CPURolloutServer`` in this process (not a Ray actor)."""
    from verl.workers.config import HFModelConfig, RolloutConfig

    config = RolloutConfig(
        name=cpu_rollout.ROLLOUT_NAME,
        dtype="float32",
        load_format=load_format,
        prompt_length=32,
        response_length=16,
        seed=seed,
        full_determinism=True,
    )
    return cpu_rollout.CPURolloutServer(config=config, model_config=HFModelConfig(path=model_dir), replica_rank=0)


def reference_sample(model, prompt_ids, *, max_tokens, temperature, top_k, top_p, stops, seed):
    """An independent sampler: a full forward over the whole prefix per token (no KV cache), the
    top-k set, then the top-p set from a sorted list of the top-k probabilities, the same draws."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids, out, log_probs = list(prompt_ids), [], []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float() / temperature
        order = torch.argsort(logits, descending=True).tolist()
        keep = order[:top_k] if top_k > 0 else order
        probs = torch.softmax(logits[keep], dim=-1)  # top-p over the top-k set, renormalised (as HF, vLLM)
        kept, mass = [], 0.0
        for token, prob in zip(keep, probs.tolist()):
            if mass >= top_p:
                break
            kept.append(token)
            mass += prob
        masked = torch.full_like(logits, float("-inf"))
        masked[kept] = logits[kept]
        token = int(torch.multinomial(torch.softmax(masked, dim=-1), 1, generator=generator))
        out.append(token)
        log_probs.append(float(torch.log_softmax(masked, dim=-1)[token]))
        ids.append(token)
        if token in stops:
            break
    return out, log_probs


def test_the_rollout_is_registered_in_verls_own_registries_on_import(cpu_rollout):
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    assert get_rollout_class(cpu_rollout.ROLLOUT_NAME, "async") is cpu_rollout.CPUServerAdapter
    assert get_rollout_replica_class(cpu_rollout.ROLLOUT_NAME) is cpu_rollout.CPURolloutReplica


def test_greedy_decode_equals_hugging_face_generate(cpu_rollout, tiny_lm):
    import torch

    model, _, prompt_ids, stops = tiny_lm
    tokens, _ = cpu_rollout.sample_tokens(
        model, prompt_ids, max_tokens=16, temperature=0, top_k=-1, top_p=1.0, stop_token_ids=stops, generator=None
    )
    reference = model.generate(
        torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=16, eos_token_id=stops, pad_token_id=0
    )[0, len(prompt_ids) :].tolist()
    assert tokens == reference


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, -1, 1.0), (0.7, 20, 0.9), (1.3, -1, 0.5)])
def test_seeded_sampling_equals_an_uncached_reference_sampler(cpu_rollout, tiny_lm, temperature, top_k, top_p):
    import torch

    model, _, prompt_ids, stops = tiny_lm
    settings = dict(max_tokens=16, temperature=temperature, top_k=top_k, top_p=top_p)
    tokens, log_probs = cpu_rollout.sample_tokens(
        model, prompt_ids, stop_token_ids=stops, generator=torch.Generator().manual_seed(3), **settings
    )
    ref_tokens, ref_log_probs = reference_sample(model, prompt_ids, stops=stops, seed=3, **settings)
    assert tokens == ref_tokens
    assert log_probs == pytest.approx(ref_log_probs, abs=1e-5)
    # Negative control: another seed draws another response.
    other, _ = reference_sample(model, prompt_ids, stops=stops, seed=4, **settings)
    assert other != tokens


def test_top_k_and_top_p_keep_the_hand_worked_token_sets(cpu_rollout):
    import torch

    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: token 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
    logits = probs.log()

    def kept(**kwargs):
        return torch.isfinite(cpu_rollout._filter_logits(logits, **kwargs)).nonzero().flatten().tolist()

    assert kept(top_k=-1, top_p=1.0) == [0, 1, 2, 3]
    assert kept(top_k=1, top_p=1.0) == [1]
    assert kept(top_k=3, top_p=1.0) == [1, 2, 3]
    assert kept(top_k=-1, top_p=0.4) == [1]  # the first token already reaches 0.4
    assert kept(top_k=-1, top_p=0.7) == [1, 3]  # 0.5 < 0.7 <= 0.8
    assert kept(top_k=-1, top_p=0.9) == [1, 2, 3]  # 0.8 < 0.9 <= 0.95
    assert kept(top_k=2, top_p=0.9) == [1, 3]


def test_server_samples_depend_only_on_seed_weight_version_and_request_id(cpu_rollout, workspace):
    server = make_server(cpu_rollout, workspace["model_dir"])
    prompt = [1, 40, 41, 42, 43]
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}

    def tokens(srv, request_id):
        return srv.generate(request_id, prompt_ids=prompt, sampling_params=dict(params)).token_ids

    first = tokens(server, "det-0")
    assert tokens(server, "det-1") != first  # another sample index, another draw (order-independent)
    assert tokens(server, "det-0") == first
    assert tokens(make_server(cpu_rollout, workspace["model_dir"]), "det-0") == first  # another process
    assert tokens(make_server(cpu_rollout, workspace["model_dir"], seed=8), "det-0") != first
    server.load_weights(server.model.state_dict(), global_steps=1)  # same weights, next version
    assert tokens(server, "det-0") != first
    output = server.generate("det-0", prompt_ids=prompt, sampling_params=dict(params))
    assert output.extra_fields["global_steps"] == 1
    assert len(output.log_probs) == len(output.token_ids) and all(lp <= 0 for lp in output.log_probs)


def test_dummy_init_generates_only_after_the_trainer_sent_weights_and_then_as_the_checkpoint(cpu_rollout, workspace):
    pretrained = make_server(cpu_rollout, workspace["model_dir"])
    dummy = make_server(cpu_rollout, workspace["model_dir"], load_format="dummy")
    request = dict(prompt_ids=[1, 40, 41, 42], sampling_params={"temperature": 1.0})
    with pytest.raises(cpu_rollout.CPURolloutError, match="before any weight update"):
        dummy.generate("det-0", **request)
    state = {k: v.clone() for k, v in pretrained.model.state_dict().items() if k != "lm_head.weight"}  # tied
    assert dummy.load_weights(state, global_steps=0) == len(state)
    assert dummy.generate("det-0", **request).extra_fields["global_steps"] == 0
    pretrained.load_weights(state, global_steps=0)  # the same weight version: the same per-request seeds
    assert dummy.generate("det-0", **request).token_ids == pretrained.generate("det-0", **request).token_ids


def test_weight_updates_with_unknown_missing_or_misshaped_tensors_are_rejected(cpu_rollout, workspace):
    import torch

    server = make_server(cpu_rollout, workspace["model_dir"])
    state = {k: v.clone() for k, v in server.model.state_dict().items()}
    with pytest.raises(cpu_rollout.CPURolloutError, match="lacks"):
        server.load_weights({**state, "model.extra.weight": torch.zeros(1)})
    name = "model.norm.weight"
    with pytest.raises(cpu_rollout.CPURolloutError, match="did not send"):
        server.load_weights({k: v for k, v in state.items() if k != name})
    with pytest.raises(cpu_rollout.CPURolloutError, match="shape"):
        server.load_weights({**state, name: torch.zeros(3)})
