"""GRPO driver: prompts -> rollout -> reward -> balanced old/ref log-probs -> advantages -> PPO updates.

``train_step(prompts)`` is one driver iteration (docs/design.md, "Walk of one GRPO step").

Invariants: rows keep the rollout's prompt-major order on the driver; every per-row tensor from the
workers goes through ``merge_by_plan``. A scored response is never dropped or cut, so every plan places
every row and a prompt's responses share a DP rank. Each logged actor metric is the mean over the
step's optimizer steps of the engine's exact global values.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace

import numpy as np
import torch

from verl_balance.batch_keys import (
    ADVANTAGES_KEY,
    ATTENTION_MASK_KEY,
    FINISH_REASON_KEY,
    INPUT_IDS_KEY,
    LOG_PROB_INPUT_KEYS,
    LOG_PROBS_KEY,
    LOSS_MASK_KEY,
    OLD_LOG_PROBS_KEY,
    ON_POLICY_KEY,
    PROMPT_INDEX_KEY,
    PROMPT_LENGTHS_KEY,
    REF_LOG_PROB_KEY,
    RESPONSE_LENGTHS_KEY,
    RETURNS_KEY,
    ROLLOUT_LOG_PROBS_KEY,
    SUM_PI_SQUARED_KEY,
    TEMPERATURE_KEY,
    UID_KEY,
    VALUES_KEY,
)
from verl_balance.data.rl_dataset import RLPromptDataset
from verl_balance.protocol import Batch
from verl_balance.rewards import load_reward_fn
from verl_balance.rewards.children import RewardChildren
from verl_balance.rewards.overlong import shape_scores
from verl_balance.rewards.score import check_reward_rules
from verl_balance.rewards.watchdog import score_batch_watched
from verl_balance.rollout.agent_loop import multi_turn_metrics
from verl_balance.trainer import checkpoint, cluster
from verl_balance.trainer.checkpoint.layout import read_json
from verl_balance.trainer.config.checks import ConfigError
from verl_balance.trainer.config.grpo import validate_grpo
from verl_balance.trainer.config.sections import check_profile_steps, resolve_data_files
from verl_balance.trainer.driver import DriverBase
from verl_balance.trainer.grpo.advantage_step import (
    compute_step_advantages,
    correct_rollout,
    prompt_baselines,
    token_level_rewards,
)
from verl_balance.trainer.grpo.critic_role import (
    NO_CRITIC,
    ActorCriticCheckpoint,
    CriticRole,
    NoCritic,
    value_metrics,
)
from verl_balance.trainer.grpo.dynamic_sampling import GroupFilter
from verl_balance.trainer.grpo.generations import decode_generations, dump_generations
from verl_balance.trainer.grpo.old_log_probs import OldLogProbs
from verl_balance.trainer.grpo.rollout_batch import merge_rollout_outputs, mini_batch_rows, prompt_batch, rollout_batch
from verl_balance.trainer.grpo.step_metrics import mean_metrics
from verl_balance.trainer.grpo.step_metrics import timed as _timed
from verl_balance.trainer.metrics import (
    EPOCH_KEY,
    PEAK_MEMORY_KEY,
    ROLLOUT_PROBS_DIFF_PREFIX,
    SCORE_MEAN_KEY,
    TIMING_ADV,
    TIMING_GEN,
    TIMING_GEN_MAX,
    TIMING_OLD_LOG_PROB,
    TIMING_REF,
    TIMING_REWARD,
    TIMING_STEP,
    TIMING_UPDATE_ACTOR,
    TIMING_VALIDATE,
    VAL_ACC_KEY,
    VAL_REWARD_KEY,
    advantage_data_metrics,
    busy_seconds,
    measured_balance_metrics,
    plan_metrics,
    reduce_rank_metrics,
    rollout_data_metrics,
    throughput_metrics,
    timing_key,
    validation_metrics,
)
from verl_balance.trainer.plan_dispatch import merge_by_plan, plan_batch, split_by_plan
from verl_balance.trainer.startup import check_critic_weights, check_model_files, check_warm_start
from verl_balance.utils.progress import DEFAULT_RL_KEYS
from verl_balance.utils.tracking import Tracking
from verl_balance.workers.actor_rollout import ActorRolloutWorker, ActorRolloutWorkerConfig, sampling_seed
from verl_balance.workers.critic import CriticWorker, CriticWorkerConfig
from verl_balance.workers.group import ActorRolloutGroup, CriticGroup

logger = logging.getLogger(__name__)
KL_COEF_STATE = "kl_ctrl_in_reward_value"
"""Trainer-state key of the in-reward KL coefficient (algorithm.use_kl_in_reward)."""
PLOT_PANELS = (
    ("train score (sampled rollouts)", r"^(critic/score/mean|reward/accuracy)$"),
    ("held-out accuracy or mean reward (val_kwargs sampling, greedy by default)", r"^val/(acc|reward_mean)$"),
    ("policy loss", r"^actor/(loss|pg_loss)$"),
    ("KL to reference, entropy, clip fraction", r"^actor/(kl_loss|ppo_kl|entropy|pg_clipfrac)$"),
    ("imbalance (1.0 = perfectly balanced)", r"^balance/imbalance"),
    ("response length", r"^(val/)?response_length/mean$"),
)
PPO_PLOT_PANELS = (
    ("train score (sampled rollouts)", r"^(critic/score/mean|reward/accuracy)$"),
    ("held-out accuracy or mean reward (val_kwargs sampling, greedy by default)", r"^val/(acc|reward_mean)$"),
    ("critic value loss", r"^critic/vf_loss$"),
    ("critic explained variance", r"^critic/vf_explained_var$"),
    ("policy loss", r"^actor/(loss|pg_loss)$"),
    ("imbalance (1.0 = perfectly balanced)", r"^balance/imbalance"),
)


# ---------------------------------------------------------------------- driver-side helpers
def rollout_probs_diff(batch: Batch) -> dict:
    """Gap between the rollout's and the actor's token probabilities (verl's ``training/rollout_probs_diff_*``)."""
    if ROLLOUT_LOG_PROBS_KEY not in batch:
        return {}
    mask = batch[LOSS_MASK_KEY].bool()
    diff = (batch[ROLLOUT_LOG_PROBS_KEY].exp() - batch[OLD_LOG_PROBS_KEY].exp()).abs()[mask]
    if diff.numel() == 0:
        return {}
    return {
        ROLLOUT_PROBS_DIFF_PREFIX + "mean": float(diff.mean()),
        ROLLOUT_PROBS_DIFF_PREFIX + "max": float(diff.max()),
    }


def update_metrics(per_rank: list[dict]) -> dict:
    """One optimizer step's metrics: engine figures, on-policy ``rollout_probs_diff`` and bypass ``rollout_corr/*``."""
    reduced = reduce_rank_metrics(per_rank, prefix="actor/")
    for name in ("mean", "max"):
        if f"actor/rollout_probs_diff_{name}" in reduced:
            reduced[ROLLOUT_PROBS_DIFF_PREFIX + name] = reduced.pop(f"actor/rollout_probs_diff_{name}")
    for key in [k for k in reduced if k.startswith("actor/rollout_corr/")]:  # bypass_mode's, verl's names
        reduced[key.removeprefix("actor/")] = reduced.pop(key)
    return {k: v for k, v in reduced.items() if k.startswith(("actor/", "perf/", "training/", "rollout_corr/"))}


# ---------------------------------------------------------------------- trainer
class GRPOTrainer(DriverBase):
    """Builds data, the actor-rollout worker group and the reward function; ``fit()`` trains."""

    plot_panels = PLOT_PANELS
    console_keys = DEFAULT_RL_KEYS
    worker_cls = ActorRolloutWorker
    trainer_modes: tuple[str, ...] = ("sync",)
    """The ``trainer.v1.trainer_mode`` values this class runs (async modes: trainer/grpo/async_trainer.py)."""
    actor: ActorRolloutGroup
    critic: CriticRole | NoCritic = NO_CRITIC
    """The critic's part of every step: a ``CriticRole`` with algorithm.adv_estimator=gae."""

    def __init__(self, cfg) -> None:
        self.config = config = validate_grpo(cfg)
        if config.trainer.v1.trainer_mode not in self.trainer_modes:
            raise ConfigError(
                f"trainer.v1.trainer_mode={config.trainer.v1.trainer_mode!r} is run by "
                f"trainer.grpo.async_trainer.grpo_trainer_class(cfg) (main_grpo picks it), not {type(self).__name__}"
            )
        arr = config.actor_rollout_ref
        self.actor_cfg, self.rollout_cfg = a, r = arr.actor, arr.rollout
        check_model_files(arr.model, chat_key="data.prompt_key")  # prompts are chats
        check_critic_weights(config)
        self.setup_run(cfg, config=config, model=arr.model)
        self._load_datasets()
        reward = config.custom_reward_function
        self.reward_fn = load_reward_fn(reward.path, reward.name, reward_kwargs=dict(reward.reward_kwargs))
        if reward.path is None:  # the built-in rules: every data_source of the data needs one, known before Ray
            check_reward_rules({**getattr(self.val_set, "data_source_rows", {}), **self.train_set.data_source_rows})
        self.reward_children = RewardChildren()  # what reward calls leave running ends with the run
        self.update_cap = a.ppo_max_token_len_per_gpu if a.use_dynamic_bsz else None
        self.log_prob_plans = {"old_log_prob": arr.log_prob_plan("old"), "ref": arr.log_prob_plan("ref")}
        self.updates_per_step = config.updates_per_step
        check_profile_steps(trainer=config.trainer, total_steps=self.total_steps)
        self.policy_loss = a.policy_loss_config()
        algorithm = config.algorithm
        self.kl_ctrl = algorithm.kl_ctrl.controller() if algorithm.use_kl_in_reward else None
        """verl's kl_ctrl_in_reward: the in-reward KL coefficient (driver state, checkpointed)."""
        worker_config = self._worker_config()
        self._check_warm_start(worker_config)
        self.start_workers(
            worker_config=worker_config,
            worker_cls=self.worker_cls,
            description=(
                f"{arr.model.describe(self.model_config)}; {len(self.train_set)} train prompts x n={r.n}, "
                f"{self.total_steps} steps of {self.updates_per_step} optimizer step(s)"
            ),
        )
        try:
            if config.use_critic:
                self.plot_panels = PPO_PLOT_PANELS
                self.critic = CriticRole(config=config.critic, start=self._start_critic_group, plan=self._plan)
            self.prepare_workers()
        except BaseException:
            self.close()
            raise

    def _check_warm_start(self, worker_config: ActorRolloutWorkerConfig) -> None:
        """Before Ray: the warm-start checkpoint's names and shapes (its DCP metadata) fit the actor."""
        path = self.config.actor_rollout_ref.model.warm_start_path
        if path:
            check_warm_start(
                os.path.abspath(path),
                key="actor_rollout_ref.model.warm_start_path",
                model_config=self.model_config,
                engine_config=worker_config.engine,
                sp_size=self.sp,
            )

    def _load_datasets(self) -> None:
        """The train/validation prompt sets (configured files or the synthetic task) and the loader."""
        d = self.config.data
        train_files, val_files = resolve_data_files(
            d, kind="rl", default_local_dir=self.config.trainer.default_local_dir
        )
        dataset_config = d.dataset_config()
        self.train_set = RLPromptDataset(files=train_files, tokenizer=self.tokenizer, config=dataset_config)
        self.val_set = (
            RLPromptDataset(files=val_files, tokenizer=self.tokenizer, config=dataset_config) if val_files else None
        )
        self.setup_loader(self.train_set, batch_size=d.train_batch_size, shuffle=d.shuffle)

    def _vllm_config(self):
        """The vLLM engines' settings (rollout.name=vllm), else None."""
        if self.config.rollout_backend != "vllm":
            return None
        return self.rollout_cfg.vllm_config(seed=self.config.trainer.seed)

    def _worker_config(self) -> ActorRolloutWorkerConfig:
        """The actor-rollout workers' config: engine config, policy loss, rollout backend and special tokens."""
        config = self.config
        return ActorRolloutWorkerConfig(
            model=self.model_config,
            engine=config.engine_config(total_steps=self.total_steps),
            sp_size=self.sp,
            policy_loss=self.policy_loss,
            loss_mode=self.config.loss_mode_config(),
            pad_token_id=self.tokenizer.pad_token_id,
            stop_token_ids=(self.tokenizer.eos_token_id,),
            rollout_max_batch_size=self.rollout_cfg.max_num_seqs,
            rollout_backend=config.rollout_backend,
            vllm=self._vllm_config(),
            use_reference_policy=config.use_reference_policy,
            multi_turn=self.rollout_cfg.multi_turn,
            chat_template=getattr(getattr(self.tokenizer, "hf_tokenizer", None), "chat_template", None),
            **self.export_options(),
        )

    def _critic_worker_config(self) -> CriticWorkerConfig:
        """The critic workers' config: a value model with the critic engine config and the value loss's clip."""
        config = self.config
        model = self.model_config
        if config.critic.model.path is not None:
            section = replace(config.actor_rollout_ref.model, path=config.critic.model.path, warm_start_path=None)
            model = section.model_config(vocab_size=self.tokenizer.vocab_size)
        if config.critic.model.enable_gradient_checkpointing is not None:
            model = replace(model, enable_gradient_checkpointing=config.critic.model.enable_gradient_checkpointing)
        return CriticWorkerConfig(
            model=model,
            engine=config.critic_engine_config(total_steps=self.total_steps),
            sp_size=self.sp,
            cliprange_value=config.critic.cliprange_value,
        )

    def _start_critic_group(self) -> CriticGroup:
        """Place the critic's workers (the actor's count and Ulysses degree) and build its engine."""
        logger.info(
            "%d critic workers: dp=%d x sp=%d; %d critic optimizer step(s) per step",
            self.world,
            self.dp,
            self.sp,
            self.config.critic_updates_per_step,
        )
        return cluster.build_actor_group(
            worker_config=self._critic_worker_config(),
            trainer_cfg=self.trainer_config,
            use_gpu=self.actor.resource_pool.use_gpu,
            worker_cls=CriticWorker,
        )

    def _trainer_state(self) -> dict:
        """The driver's state; with use_kl_in_reward also the KL controller's coefficient."""
        state = super()._trainer_state()
        if self.kl_ctrl is not None:
            state[KL_COEF_STATE] = self.kl_ctrl.value
        return state

    def _load(self, path: str) -> None:
        """Resume the driver's state; an adaptive KL coefficient continues from the checkpoint's."""
        super()._load(path)
        if self.kl_ctrl is None:
            return
        state = read_json(os.path.join(path, checkpoint.TRAINER_STATE_FILE)) or {}
        if KL_COEF_STATE in state:
            self.kl_ctrl.value = float(state[KL_COEF_STATE])
        else:
            logger.warning("checkpoint %s holds no %s: the KL coefficient restarts at kl_coef", path, KL_COEF_STATE)

    @property
    def checkpoint_group(self):
        """The actor's group, or with a critic both (``ActorCriticCheckpoint``)."""
        return self.critic.checkpoint_group(self.actor)

    def close(self) -> None:
        """Stop the critic's workers too (the actor's and the run directory: ``DriverBase.close``)."""
        try:
            if getattr(self, "reward_children", None) is not None:
                self.reward_children.reap()
            self.critic.release()
        finally:
            super().close()

    def restart_workers(self) -> None:
        """A dead worker (actor's or critic's) replaces both groups; both resume from the checkpoint."""
        self.critic.restart()
        super().restart_workers()

    def prepare_workers(self) -> None:
        """Warm start and the frozen reference policy; run on every newly built worker group."""
        arr = self.config.actor_rollout_ref
        if arr.model.warm_start_path:
            path = os.path.abspath(arr.model.warm_start_path)
            try:  # the files must match their checksums before any rank reads them
                checkpoint.verify_checkpoint(
                    path,
                    hasher=checkpoint.group_hasher(self.actor),
                    allow_unverified=self.config.trainer.allow_unverified_checkpoint,
                )
            except (checkpoint.CheckpointCorruptError, checkpoint.CheckpointUnverifiedError) as err:
                key = f"actor_rollout_ref.model.warm_start_path={arr.model.warm_start_path!r}"
                raise type(err)(f"{key}: {err}") from err
            self.actor.load_model_weights(path)
            logger.info("warm start: weights of %s", arr.model.warm_start_path)
            self.critic.warm_start(path)
        if self.config.use_reference_policy:
            self.actor.sync_reference_policy()

    # ------------------------------------------------------------------ phases
    def generate(self, prompts: tuple[dict, dict], *, n: int, temperature: float, top_p: float, seed: int) -> Batch:
        """Rollout batch (one row per response, prompt-major) with uid/data_source/ground_truth columns."""
        rows = prompt_batch(prompts, multi_turn=self.rollout_cfg.multi_turn.enable)
        bounds = np.linspace(0, len(rows), self.world + 1).round().astype(int)
        chunks = [rows.index_select(np.arange(lo, hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]
        sampling = {
            "n": n,
            "temperature": temperature,
            "top_p": top_p,
            "max_response_length": self.rollout_cfg.response_length,
        }
        outputs = self.actor.generate_sequences(chunks, sampling, seed)
        output = merge_rollout_outputs(
            outputs, prompt_offsets=bounds[:-1].tolist(), pad_token_id=self.tokenizer.pad_token_id
        )
        return rollout_batch(prompts, output, pad_token_id=self.tokenizer.pad_token_id)

    def score(self, batch: Batch) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Reward of every response: (scores [B], extra per-sample metrics such as ``acc``)."""
        starts = batch[PROMPT_LENGTHS_KEY].tolist()
        ends = (batch[PROMPT_LENGTHS_KEY] + batch[RESPONSE_LENGTHS_KEY]).tolist()
        ids = batch[INPUT_IDS_KEY].tolist()
        solutions = [self.tokenizer.decode(row[s:e]) for row, s, e in zip(ids, starts, ends)]
        reward = self.config.custom_reward_function
        scores, extras = score_batch_watched(
            reward_fn=self.reward_fn,
            data_sources=list(batch["data_source"]),
            solutions=solutions,
            ground_truths=list(batch["ground_truth"]),
            extra_infos=list(batch["extra_info"]),
            timeout_s=reward.timeout_s,
            heartbeat_s=self.config.trainer.heartbeat_interval_s,
            name=f"{reward.name or 'compute_score'} of {reward.path}" if reward.path else None,
            children=self.reward_children,
        )
        if reward.reward_manager != "dapo":
            return scores, extras
        return shape_scores(  # verl's dapo reward manager: the overlong penalty
            scores,
            extras,
            response_lengths=batch[RESPONSE_LENGTHS_KEY].numpy(),
            max_resp_len=reward.max_resp_len or self.rollout_cfg.response_length,
            config=reward.overlong_buffer,
        )

    def _plan(self, batch: Batch, *, micro_batch_size, token_cap):
        """Every group (a prompt's responses) on one DP rank, packed into micro-batches freely."""
        return plan_batch(
            batch,
            dp_size=self.dp,
            sp_size=self.sp,
            micro_batch_size=micro_batch_size,
            token_cap=token_cap,
            balance=self.config.balance_enabled,
            workload=self.workload,
            overlong="error",
            group_ids=batch[PROMPT_INDEX_KEY],
            group_scope="rank",
        )

    def _mini_batches(self, batch: Batch) -> list[np.ndarray]:
        """Row indices of each actor mini-batch: ``ppo_mini_batch_size`` consecutive prompts, all their responses."""
        return mini_batch_rows(batch, size=self.actor_cfg.ppo_mini_batch_size)

    def old_log_probs(self) -> OldLogProbs:
        """This step's old-log-prob decision (from the config: the on-policy update, bypass_mode or the pass)."""
        return OldLogProbs.sync(self.config)

    def train_step(self, prompts: tuple[dict, dict]) -> dict:
        """One driver iteration (one GRPO step) on one batch of prompts; returns the step's metrics."""
        metrics: dict = {}
        old_log_probs = self.old_log_probs()
        with _timed(metrics, TIMING_STEP):
            if self.config.algorithm.filter_groups.enable:
                batch, scores, extras = self._dynamic_sampling(prompts, metrics)
                pending = self._submit_passes(batch, metrics, old_log_probs=old_log_probs)
            else:
                batch = self._generate_step(prompts, metrics, seed=self.global_step)
                # The log-prob (and values) passes run on the workers while the driver scores the responses.
                pending = self._submit_passes(batch, metrics, old_log_probs=old_log_probs)
                with _timed(metrics, TIMING_REWARD):
                    scores, extras = self.score(batch)
            self._dump_rollout(batch, scores, extras)
            baselines = self._greedy_baselines(prompts, batch, metrics)
            self.phase("log-prob passes")
            self._collect_log_prob_passes(batch, pending, metrics)
            with _timed(metrics, TIMING_ADV):
                metrics.update(self._attach_advantages(batch, scores, extras, baselines=baselines))
            self.critic.train(batch, metrics=metrics, phase=self.phase)
            # verl's trainer.critic_warmup: the actor waits for the critic (0 without one).
            if self.global_step >= self.config.trainer.critic_warmup:
                self.phase("actor update")
                with _timed(metrics, TIMING_UPDATE_ACTOR):
                    metrics.update(self.train_actor(batch, on_policy=old_log_probs.from_update))
        metrics.update(self._rollout_metrics(batch, scores, extras))
        tokens = int(batch[ATTENTION_MASK_KEY].sum())
        metrics.update(
            throughput_metrics(tokens=tokens, step_seconds=metrics[timing_key(TIMING_STEP)], num_devices=self.world)
        )
        metrics.update(
            {
                EPOCH_KEY: float(self.loader.epoch),
                "train/old_log_prob_pass": float(old_log_probs.recompute),
            }
        )
        return metrics

    def _generate_step(self, prompts: tuple[dict, dict], metrics: dict, *, seed: int) -> Batch:
        """The step's rollout batch (``rollout.n`` responses per prompt); with bypass_mode its log-probs are the old."""
        r = self.rollout_cfg
        self.phase("rollout")
        with _timed(metrics, TIMING_GEN):
            batch = self.generate(
                prompts,
                n=r.n,
                temperature=r.temperature,
                top_p=r.top_p,
                seed=sampling_seed(self.config.trainer.seed, seed),
            )
        # Old, reference and new log-probs are all taken at the sampling temperature.
        batch.meta[TEMPERATURE_KEY] = float(r.temperature)
        metrics.update(multi_turn_metrics(batch.non_tensors))
        if self.config.algorithm.rollout_correction.bypass_mode:
            batch[OLD_LOG_PROBS_KEY] = batch[ROLLOUT_LOG_PROBS_KEY].clone()  # verl's apply_bypass_mode
        return batch

    def _dynamic_sampling(self, prompts: tuple[dict, dict], metrics: dict) -> tuple[Batch, np.ndarray, dict]:
        """DAPO: generate and score batches until ``data.train_batch_size`` prompts have varying responses."""
        groups = self.config.algorithm.filter_groups
        kept = GroupFilter(
            metric=groups.metric,
            train_batch_size=self.config.data.train_batch_size,
            max_num_gen_batches=groups.max_num_gen_batches,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        while True:
            batch = self._generate_step(prompts, metrics, seed=self.global_step)
            with _timed(metrics, TIMING_REWARD):
                scores, extras = self.score(batch)
            if kept.add(batch, scores=scores, extras=extras):
                break
            prompts = next(iter(self.loader))  # the loader's next batch: a resume continues after it
        metrics.update(kept.metrics())
        return kept.result()

    def _submit_passes(self, batch: Batch, metrics: dict, *, old_log_probs: OldLogProbs) -> dict:
        """Start the log-prob passes and (with a critic) the values pass, without waiting."""
        pending = self._submit_log_prob_passes(batch, metrics, old_log_probs=old_log_probs)
        self.critic.submit_values(batch, pending=pending, metrics=metrics)
        return pending

    def _submit_log_prob_passes(self, batch: Batch, metrics: dict, *, old_log_probs: OldLogProbs) -> dict:
        """Start the old (if recomputed) and reference log-prob passes, not waiting; {name: (plan, GroupFuture)}."""
        passes = {}
        if old_log_probs.recompute:
            passes["old_log_prob"] = self.actor.compute_log_prob
        if self.config.use_reference_policy:
            passes["ref"] = self.actor.compute_ref_log_prob
        if not passes:
            return {}
        inputs = batch.select(batch_keys=LOG_PROB_INPUT_KEYS, non_tensor_batch_keys=[])
        cut: dict = {}
        pending = {}
        # The optimal-token baselines read sum_v pi^2 from the old log-prob pass (verl's calculate_sum_pi_squared).
        kwargs = {"old_log_prob": {"with_sum_pi_squared": True} if self.config.algorithm.needs_sum_pi_squared else {}}
        for name, call in passes.items():
            with _timed(metrics, name):  # planning and cutting count to the first pass using the plan
                spec = self.log_prob_plans[name]
                if spec not in cut:
                    plan = self._plan(batch, micro_batch_size=spec.micro_batch_size, token_cap=spec.token_cap)
                    cut[spec] = (plan, split_by_plan(inputs, plan))
                plan, chunks = cut[spec]
                pending[name] = (plan, call.submit(chunks, **kwargs.get(name, {})))
        return pending

    def _greedy_baselines(self, prompts: tuple[dict, dict], batch: Batch, metrics: dict) -> torch.Tensor | None:
        """remax's baseline (verl's): the score of one greedy response per prompt, per row; None otherwise."""
        if self.config.algorithm.adv_estimator != "remax":
            return None
        self.phase("greedy baseline")
        with _timed(metrics, TIMING_GEN_MAX):
            greedy = self.generate(prompts, n=1, temperature=0.0, top_p=1.0, seed=self.config.trainer.seed)
            greedy_scores, _ = self.score(greedy)
        metrics["reward/greedy_baseline_mean"] = float(np.mean(greedy_scores))  # ours: verl logs none
        return prompt_baselines(
            baseline_prompt_index=greedy[PROMPT_INDEX_KEY],
            baseline_scores=greedy_scores,
            row_prompt_index=batch[PROMPT_INDEX_KEY],
        )

    def _attach_advantages(
        self, batch: Batch, scores: np.ndarray, extras: dict, *, baselines: torch.Tensor | None = None
    ) -> dict:
        """``advantages`` (and with gae ``returns``) after the decoupled rollout correction; its metrics."""
        algorithm = self.config.algorithm
        rewards, metrics = token_level_rewards(batch, scores=scores, algorithm=algorithm, kl_controller=self.kl_ctrl)
        metrics.update(correct_rollout(batch, algorithm=algorithm))
        out = compute_step_advantages(
            batch, scores=scores, extras=extras, algorithm=algorithm, reward_baselines=baselines, rewards=rewards
        )
        batch[ADVANTAGES_KEY] = out.advantages
        metrics.update(advantage_data_metrics(rewards=rewards, advantages=out.advantages, mask=batch[LOSS_MASK_KEY]))
        self.critic.attach_returns(batch, out.returns)
        return metrics

    def _collect_log_prob_passes(self, batch: Batch, pending: dict, metrics: dict) -> None:
        """Wait for the submitted passes and attach ``old_log_probs`` / ``ref_log_prob`` in row order."""
        if "old_log_prob" in pending:
            plan, future = pending["old_log_prob"]
            with _timed(metrics, TIMING_OLD_LOG_PROB):
                merged = merge_by_plan(future.get(), plan)
                batch[OLD_LOG_PROBS_KEY] = merged[LOG_PROBS_KEY]
                if SUM_PI_SQUARED_KEY in merged:
                    batch[SUM_PI_SQUARED_KEY] = merged[SUM_PI_SQUARED_KEY]
            metrics.update(rollout_probs_diff(batch))
        if "ref" in pending:
            plan, future = pending["ref"]
            with _timed(metrics, TIMING_REF):
                batch[REF_LOG_PROB_KEY] = merge_by_plan(future.get(), plan)[REF_LOG_PROB_KEY]
        if VALUES_KEY in pending:
            plan, future = pending[VALUES_KEY]
            with _timed(metrics, VALUES_KEY):
                batch[VALUES_KEY] = merge_by_plan(future.get(), plan)[VALUES_KEY]

    def train_actor(self, batch: Batch, *, on_policy: bool) -> dict:
        """ppo_epochs x mini-batches optimizer steps; mean actor metrics, plan and measured balance."""
        a = self.actor_cfg
        actor_records, plan_records = [], []
        busy = np.zeros(self.dp)
        drop = {VALUES_KEY, RETURNS_KEY, SUM_PI_SQUARED_KEY} & set(batch.tensor_keys)  # read on the driver only
        if not on_policy and ROLLOUT_LOG_PROBS_KEY in batch:
            # Compared with the old log-probs on the driver (rollout_probs_diff); not needed on the wire.
            drop.add(ROLLOUT_LOG_PROBS_KEY)
        if not a.use_kl_loss and REF_LOG_PROB_KEY in batch:
            drop.add(REF_LOG_PROB_KEY)  # read by the KL in the reward only
        if drop:
            batch = batch.select(batch_keys=[k for k in batch.tensor_keys if k not in drop])
        for _ in range(a.ppo_epochs):
            for rows in self._mini_batches(batch):
                mini = batch.index_select(rows)
                mini.meta[ON_POLICY_KEY] = on_policy
                plan = self._plan(mini, micro_batch_size=a.ppo_micro_batch_size_per_gpu, token_cap=self.update_cap)
                per_rank = self.actor.update_actor(split_by_plan(mini, plan))
                actor_records.append(update_metrics(per_rank))
                plan_records.append(plan_metrics(plan))
                busy += busy_seconds(per_rank)
        out = {**mean_metrics(actor_records), **mean_metrics(plan_records)}
        peak_memory = [r[PEAK_MEMORY_KEY] for r in actor_records if PEAK_MEMORY_KEY in r]
        if peak_memory:
            out[PEAK_MEMORY_KEY] = float(max(peak_memory))  # the step's peak, not the mean of the updates'
        out["actor/num_optimizer_steps"] = float(len(actor_records))
        # Busy time summed over the step's updates: every rank waits for the slowest at each.
        out.update(measured_balance_metrics(busy))
        return out

    def _rollout_metrics(self, batch: Batch, scores: np.ndarray, extras: dict) -> dict:
        return rollout_data_metrics(
            scores=scores,
            extras=extras,
            response_lengths=batch[RESPONSE_LENGTHS_KEY].numpy(),
            finish_reasons=batch[FINISH_REASON_KEY],
            prompt_lengths=batch[PROMPT_LENGTHS_KEY].numpy(),
            max_prompt_length=self.config.data.max_prompt_length,
        )

    def evaluate(self) -> dict:
        """Held-out accuracy with ``rollout.val_kwargs`` sampling (greedy by default), overall and per source."""
        if self.val_set is None:
            return {}
        val_batch_size = self.config.data.val_batch_size
        count = len(self.val_set) if val_batch_size is None else min(val_batch_size, len(self.val_set))
        prompts = self.val_set.collate([self.val_set[i] for i in range(count)])
        v = self.rollout_cfg.val_kwargs
        start = time.perf_counter()
        batch = self.generate(prompts, n=v.n, temperature=v.temperature, top_p=v.top_p, seed=self.config.trainer.seed)
        scores, extras = self.score(batch)
        metrics = validation_metrics(
            scores=scores,
            extras=extras,
            sources=np.asarray(batch["data_source"]),
            uids=np.asarray(batch[UID_KEY]),
            response_lengths=batch[RESPONSE_LENGTHS_KEY].numpy(),
        )
        metrics[timing_key(TIMING_VALIDATE)] = time.perf_counter() - start
        self._log_generations(batch, scores, count=self.config.trainer.log_val_generations)
        if self.config.trainer.validation_data_dir:
            dump_generations(
                self.config.trainer.validation_data_dir,
                step=self.global_step,
                batch=batch,
                tokenizer=self.tokenizer,
                scores=scores,
                extras=extras,
            )
        return metrics

    def _dump_rollout(self, batch: Batch, scores: np.ndarray, extras: dict) -> None:
        """verl's ``trainer.rollout_data_dir``: this step's responses and scores as ``<step>.jsonl``."""
        if self.config.trainer.rollout_data_dir:
            dump_generations(
                self.config.trainer.rollout_data_dir,
                step=self.global_step + 1,
                batch=batch,
                tokenizer=self.tokenizer,
                scores=scores,
                extras=extras,
            )

    def _log_generations(self, batch: Batch, scores: np.ndarray, *, count: int) -> None:
        """verl's ``trainer.log_val_generations``: the first ``count`` validation samples, logged."""
        if count <= 0:
            return
        prompts, responses = decode_generations(batch, self.tokenizer, skip_special_tokens=False, limit=count)
        for i in range(len(prompts)):
            logger.info(
                "val sample %d: %r -> %r (score %g, truth %r)",
                i,
                prompts[i],
                responses[i],
                scores[i],
                batch["ground_truth"][i],
            )

    def before_training(self, tracker: Tracking) -> dict:
        """verl's ``trainer.val_before_train``: held-out accuracy of the initial policy at step 0."""
        if not self.config.trainer.val_before_train:
            return {}
        metrics = self.evaluate()
        tracker.log(metrics, step=0)
        return metrics

    def summarize(self, *, first: dict, last: dict, first_val: dict, last_val: dict) -> dict:
        """First/final train reward and held-out accuracy before/after training."""
        val_key = VAL_ACC_KEY if VAL_ACC_KEY in {**first_val, **last_val} else VAL_REWARD_KEY
        return {
            "algorithm": self.critic.algorithm,
            "first_reward": first.get(SCORE_MEAN_KEY),
            "final_reward": last.get(SCORE_MEAN_KEY),
            "val_key": val_key,
            "initial_val": first_val.get(val_key),
            "final_val": last_val.get(val_key),
        }

    summary_title = "GRPO"

    @classmethod
    def summary_lines(cls, summary: dict) -> list[str]:
        """Train reward first -> final; held-out ``val/acc`` (else ``val/reward_mean``) before -> after."""
        lines = []
        if summary.get("first_reward") is not None:
            first_score, final_score = summary["first_reward"], summary["final_reward"]
            lines.append(f"train score ({SCORE_MEAN_KEY}): first {first_score:.4f} -> final {final_score:.4f}")
        first, last = summary.get("initial_val"), summary.get("final_val")
        if first is not None or last is not None:
            fmt = lambda x: "n/a" if x is None else f"{x:.4f}"  # noqa: E731
            what = (
                "held-out accuracy (val/acc)"
                if summary["val_key"] == VAL_ACC_KEY
                else "held-out mean reward (val/reward_mean)"
            )
            lines.append(f"{what}: before {fmt(first)} -> after {fmt(last)}")
        return lines


format_summary = GRPOTrainer.format_summary
"""The end-of-run lines of a GRPO/PPO run (``DriverBase.format_summary``; titled by ``algorithm``)."""


__all__ = [
    "ActorCriticCheckpoint",
    "GRPOTrainer",
    "OldLogProbs",
    "format_summary",
    "merge_rollout_outputs",
    "value_metrics",
]
