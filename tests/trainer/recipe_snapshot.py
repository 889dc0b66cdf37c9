"""The component configs each recipe hands its components (engine, balancer, dataset, policy
loss, rollout, model), built from the recipe YAML plus the overrides of recipes/*.sh and a few
non-default layouts, as plain JSON values. ``tests/trainer/data/recipe_components.json`` holds
them as built before the config layer was split (issue 18), with verl's defaults since issue 30
(SFT: save and validate at the last step: ``last_step``; ``data.messages_key`` stays null, which reads
verl's default ``messages`` column where a file has one, see ``data.sft_dataset.chat_column``); the test in
test_config.py rebuilds them with the current API (``RecipeConfig.engine_config`` etc.) and compares field by field.

Regenerate (only when a change of a component config is intended):
    PYTHONPATH=$PWD python -m tests.trainer.recipe_snapshot
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path

SNAPSHOT = Path(__file__).parent / "data" / "recipe_components.json"
CONFIG_DIR = Path(__file__).resolve().parents[2] / "verl_balance" / "config"
TOTAL_STEPS = 12
"""Run length given to the engine config (the trainers take it from the loader)."""

DEMO_DIMS = ["hidden_size=64", "intermediate_size=192", "num_layers=2"]
CASES: dict[str, tuple[str, list[str]]] = {
    "sft_defaults": ("sft", []),
    "sft_cpu_demo": (
        "sft",
        ["trainer.device=cpu", "trainer.n_gpus_per_node=4", "ulysses_sequence_parallel_size=2"]
        + [f"model.{d}" for d in DEMO_DIMS]
        + ["data.train_batch_size=32", "data.micro_batch_size_per_gpu=4", "balance.enable=true"]
        + ["balance.workload=flops", "optim.lr=3e-3", "trainer.total_epochs=1", "trainer.test_freq=16"],
    ),
    "sft_gpu_8x": (
        "sft",
        ["trainer.device=cuda", "trainer.n_gpus_per_node=8", "ulysses_sequence_parallel_size=2"]
        + ["model.name=100m", "model.param_dtype=bfloat16", "data.train_batch_size=256", "data.max_length=4096"]
        + ["data.use_dynamic_bsz=true", "data.max_token_len_per_gpu=16384", "optim.lr=3e-4"]
        + ["trainer.test_freq=50", "trainer.save_freq=200", "trainer.profile_steps=[2,3]"],
    ),
    "sft_gpu_8x_hf": (
        "sft",
        ["trainer.n_gpus_per_node=8", "ulysses_sequence_parallel_size=2", "model.path=<hf>"]
        + ["model.enable_gradient_checkpointing=true", "trainer.save_hf_model=true", "model.param_dtype=bfloat16"]
        + ["data.use_dynamic_bsz=true", "data.max_token_len_per_gpu=16384", "optim.lr=1e-5"],
    ),
    "sft_hf_partial_pretrain": ("sft", ["model.partial_pretrain=<hf>", "model.init=random"]),
    "sft_parity_dp1_sp4": (
        "sft",
        ["trainer.n_gpus_per_node=4", "ulysses_sequence_parallel_size=4", "data.use_dynamic_bsz=true"]
        + ["data.max_token_len_per_gpu=512", "trainer.total_training_steps=20", "balance.enable=false"]
        + ["model.fsdp_config.reshard_after_forward=false", "model.logits_chunk_size=0"]
        + ["loss_agg_mode=seq-mean-token-sum-norm", "loss_scale_factor=64", "balance.workload=tokens"],
    ),
    "grpo_defaults": ("grpo", []),
    "grpo_cpu_demo": (
        "grpo",
        ["trainer.device=cpu", "trainer.n_gpus_per_node=2"]
        + [f"actor_rollout_ref.model.{d}" for d in DEMO_DIMS]
        + ["actor_rollout_ref.model.warm_start_path=<ckpt>", "data.max_prompt_length=32"]
        + ["data.train_batch_size=32", "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.rollout.temperature=1.0"]
        + ["actor_rollout_ref.rollout.response_length=10", "actor_rollout_ref.actor.ppo_mini_batch_size=16"]
        + ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=256"]
        + ["actor_rollout_ref.actor.optim.lr=3e-4", "actor_rollout_ref.actor.use_kl_loss=true"]
        + ["actor_rollout_ref.actor.kl_loss_coef=0.001", "algorithm.adv_estimator=grpo", "trainer.balance_batch=true"]
        + ["trainer.total_training_steps=40", "trainer.test_freq=5", "trainer.log_val_generations=4"],
    ),
    "grpo_sp2_epochs_dynamic": (
        "grpo",
        ["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"]
        + ["actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
        + [
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=512",
        ]
        + ["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.max_num_seqs=8"]
        + ["trainer.balance_batch=false", "balance.workload=tokens", "trainer.profile_steps=[1]"]
        + [
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
            "actor_rollout_ref.actor.loss_scale_factor=32",
        ]
        + ["algorithm.adv_estimator=rloo"]
        + ["actor_rollout_ref.actor.fsdp_config.defer_gradient_sync=true"],
    ),
    "grpo_top_level_sp_hf": (
        "grpo",
        ["trainer.n_gpus_per_node=4", "ulysses_sequence_parallel_size=2", "actor_rollout_ref.model.path=<hf>"]
        + ["actor_rollout_ref.model.param_dtype=bfloat16", "actor_rollout_ref.actor.recompute_old_log_prob=always"],
    ),
}


def make_fixtures(root: Path) -> dict[str, str]:
    """The directories the cases name: a tiny HF model and a (fake) engine checkpoint."""
    from verl_balance.models.tiny_hf import write_tiny_model
    from verl_balance.trainer.checkpoint import TRAINER_STATE_FILE

    hf = root / "hf"
    if not (hf / "config.json").exists():
        write_tiny_model(str(hf), family="qwen2")
    ckpt = root / "global_step_3"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / TRAINER_STATE_FILE).write_text("{}")
    return {"<hf>": str(hf), "<ckpt>": str(ckpt)}


def plain(value):
    """JSON values of a dataclass / tuple tree (tuples as lists)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            "__class__": type(value).__name__,
            **{f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)},
        }
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def component_configs(recipe: str, overrides: list[str], root: Path) -> dict:
    """The component configs of one recipe run, built with the current config API."""
    from tests.trainer.conftest import compose_config
    from verl_balance.trainer.config.grpo import register_grpo_schema

    register_grpo_schema()
    fixtures = make_fixtures(root)
    resolved = []
    for item in overrides:
        for name, path in fixtures.items():
            item = item.replace(name, path)
        resolved.append(item)
    resolved.append(f"trainer.default_local_dir={root / 'run'}")
    cfg = compose_config(recipe, resolved)
    out = _sft_components(cfg) if recipe == "sft" else _grpo_components(cfg)
    text = json.dumps(plain(out), sort_keys=True)
    for name, path in fixtures.items():
        text = text.replace(path, name)
    return json.loads(text.replace(str(root), "<root>"))


def _sft_components(cfg) -> dict:
    from verl_balance.trainer.config import validate_sft

    config = validate_sft(cfg)
    out = {
        "engine": config.engine_config(total_steps=TOTAL_STEPS),
        "dataset": config.data.dataset_config(),
        "sp_size": config.sp_size,
        "world_size": config.trainer.world_size,
        "plan": {
            "balance": config.balance_enabled,
            "overlong": config.balance.overlong,
            "micro_batch_size": config.data.micro_batch_size_per_gpu,
            "token_cap": config.data.max_token_len_per_gpu if config.data.use_dynamic_bsz else None,
        },
    }
    return {**out, **_model_and_workload(config, config.model), **_last_step(config.trainer)}


def _last_step(trainer) -> dict:
    """Whether the run's last step saves and validates (verl's rule: always in SFT, freq > 0 in GRPO)."""
    return {
        "last_step": {
            "save": trainer.save_due(TOTAL_STEPS, is_last=True),
            "validate": trainer.validate_due(TOTAL_STEPS, is_last=True),
        }
    }


def _model_and_workload(config, section) -> dict:
    from verl_balance.data.tokenizer import build_tokenizer

    model = section.model_config(vocab_size=build_tokenizer(section.tokenizer_path).vocab_size)
    return {
        "model": {"__class__": type(model).__name__, **model.to_dict()},
        "workload": config.balance.workload_for(model),
    }


def _grpo_components(cfg) -> dict:
    from verl_balance.trainer.config.grpo import validate_grpo

    config = validate_grpo(cfg)
    arr = config.actor_rollout_ref
    a, r, d = arr.actor, arr.rollout, config.data
    out = {
        "engine": config.engine_config(total_steps=TOTAL_STEPS),
        "dataset": d.dataset_config(),
        "synthetic_task": d.synthetic.task_config(),
        "policy_loss": a.policy_loss_config(),
        "sp_size": config.sp_size,
        "world_size": config.trainer.world_size,
        "updates_per_step": config.updates_per_step,
        "old_log_prob_from_update": config.old_log_prob_from_update,
        "warm_start_path": arr.model.warm_start_path,
        "plan": {
            "balance": config.balance_enabled,
            "update_cap": a.ppo_max_token_len_per_gpu if a.use_dynamic_bsz else None,
            "log_prob_cap": arr.log_prob_plan("old").token_cap,
            "log_prob_mbs": arr.log_prob_plan("old").micro_batch_size,
            "ref_log_prob": arr.log_prob_plan("ref"),
            "update_mbs": a.ppo_micro_batch_size_per_gpu,
        },
        "rollout": {
            "n": r.n,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "response_length": r.response_length,
            "max_num_seqs": r.max_num_seqs,
            "val_kwargs": r.val_kwargs,
        },
    }
    return {**out, **_model_and_workload(config, arr.model), **_last_step(config.trainer)}


def all_component_configs(root: Path) -> dict:
    return {name: component_configs(recipe, overrides, root) for name, (recipe, overrides) in CASES.items()}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        snapshot = all_component_configs(Path(tmp))
    SNAPSHOT.parent.mkdir(parents=True, exist_ok=True)
    SNAPSHOT.write_text(json.dumps(snapshot, indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT} ({len(snapshot)} cases)", os.linesep.join(sorted(snapshot)))
