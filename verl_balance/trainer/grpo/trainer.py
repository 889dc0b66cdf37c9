"""GRPO driver: prompts -> rollout -> reward -> balanced old/ref log-probs -> advantages -> PPO updates.

One training step, for ``data.train_batch_size`` prompts:

1. generate ``rollout.n`` responses per prompt on the colocated rollout (every worker samples for
   its share of the prompts with the actor's current weights);
2. plan the whole batch over DP ranks (``trainer.balance_batch``: by workload, a prompt's responses
   kept on one DP rank, ``group_scope="rank"``) and start the old (and reference) log-prob passes
   through that plan without waiting;
3. meanwhile score every response on the driver with the reward function
   (``custom_reward_function`` or the built-in rule for its ``data_source``), then collect the
   passes and merge them back to the batch's own row order;
4. advantages of ``algorithm.adv_estimator`` (any of verl's estimators whose inputs the trainer
   supplies, trainer/grpo/advantage_step.py; remax adds one greedy baseline response per prompt), from
   the scores minus the KL penalty (``algorithm.use_kl_in_reward``) after verl's decoupled rollout
   correction (``algorithm.rollout_correction``: IS weights, rejected tokens out of the loss mask);
5. for each of ``ppo_epochs``, for each mini-batch of ``ppo_mini_batch_size`` prompts (all their
   responses): its own plan and one ``update_actor`` call = one optimizer step.

PPO with a critic (``algorithm.adv_estimator=gae``) adds a second worker group, the critic (a value
model, ``workers/critic.py``, with the actor's world size and Ulysses degree): its values pass runs
through its own plan beside the log-prob passes (2.), the advantages and returns are GAE's (4.),
the critic takes ``critic.ppo_epochs`` x mini-batches of value-loss steps, each with its own plan,
and the actor's update (5.) is skipped during the first ``trainer.critic_warmup`` steps. The
critic's state is saved with the actor's in every ``global_step_N`` (under ``critic/``, in the
same checksum manifest) and restored with it.

DAPO (``algorithm.filter_groups.enable``) scores before the passes: 1. and 3. repeat on the loader's
next prompt batches until ``data.train_batch_size`` prompts have responses that differ in the
metric (trainer/grpo/dynamic_sampling.py); the dapo reward manager adds the overlong penalty to every score.

On-policy steps (``actor.recompute_old_log_prob=auto``, ``ppo_epochs=1``, one mini-batch) skip the
old-log-prob pass: the single update is the first forward of the sampled weights, so the PPO loss
takes ``log_prob.detach()`` as the old log-probs (ratio exactly 1; ``PPOLoss(on_policy=True)``) and
reports the rollout-vs-trainer gap from that forward. docs/verl.md section 8 says
why this is exact.

Invariants: rows keep the rollout's prompt-major order on the driver; every per-row tensor that
comes back from workers goes through ``merge_by_plan`` before it is attached. A response is never
dropped or cut after it was scored (GRPO accepts ``balance.overlong=error`` only), so every plan
places every row. Each logged actor metric is the mean over the step's optimizer steps of the
engine's exact global values (loss-mask-weighted token means over each mini-batch).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import replace

import numpy as np
import torch

from verl_balance.batch_keys import (
    ADVANTAGES_KEY,
    ATTENTION_MASK_KEY,
    CRITIC_UPDATE_KEYS,
    FINISH_REASON_KEY,
    INDEX_KEY,
    INPUT_IDS_KEY,
    LOG_PROB_INPUT_KEYS,
    LOG_PROBS_KEY,
    LOSS_MASK_KEY,
    OLD_LOG_PROBS_KEY,
    ON_POLICY_KEY,
    PROMPT_IDS_KEY,
    PROMPT_INDEX_KEY,
    PROMPT_LENGTHS_KEY,
    REF_LOG_PROB_KEY,
    RESPONSE_LENGTHS_KEY,
    RETURNS_KEY,
    ROLLOUT_LOG_PROBS_KEY,
    SAMPLE_INDEX_KEY,
    SUM_PI_SQUARED_KEY,
    TEMPERATURE_KEY,
    UID_KEY,
    VALUES_KEY,
)
from verl_balance.data.rl_dataset import RLPromptDataset
from verl_balance.protocol import Batch
from verl_balance.rewards import load_reward_fn
from verl_balance.rewards.overlong import shape_scores
from verl_balance.rewards.watchdog import score_batch_watched
from verl_balance.rollout import RolloutOutput, build_rollout_batch
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
from verl_balance.trainer.grpo.dynamic_sampling import GroupFilter
from verl_balance.trainer.grpo.generations import decode_generations, dump_generations
from verl_balance.trainer.metrics import (
    EPOCH_KEY,
    PEAK_MEMORY_KEY,
    RETURNS_PREFIX,
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
    TIMING_UPDATE_CRITIC,
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
from verl_balance.trainer.startup import check_model_files
from verl_balance.utils.progress import DEFAULT_RL_KEYS
from verl_balance.utils.tracking import Tracking
from verl_balance.workers.actor_rollout import ActorRolloutWorker, ActorRolloutWorkerConfig, sampling_seed
from verl_balance.workers.critic import CriticWorker, CriticWorkerConfig
from verl_balance.workers.group import ActorRolloutGroup, CriticGroup

logger = logging.getLogger(__name__)
KL_COEF_STATE = "kl_ctrl_in_reward_value"
"""Trainer-state key of the in-reward KL coefficient (algorithm.use_kl_in_reward)."""
CRITIC_CHECKPOINT_DIR = "critic"
"""The critic's shards inside a ``global_step_N`` checkpoint (the actor's are at its root)."""
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
def merge_rollout_outputs(
    outputs: list[RolloutOutput | None], *, prompt_offsets: list[int], pad_token_id: int
) -> RolloutOutput:
    """One RolloutOutput from per-worker outputs; worker w answered prompts from ``prompt_offsets[w]``."""
    parts = [(o, off) for o, off in zip(outputs, prompt_offsets) if o is not None]
    width = max(o.responses.shape[1] for o, _ in parts)

    def pad(t, value):
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    has_log_probs = all(o.log_probs is not None for o, _ in parts)
    return RolloutOutput(
        prompt_index=np.concatenate([o.prompt_index + off for o, off in parts]),
        responses=torch.cat([pad(o.responses, pad_token_id) for o, _ in parts]),
        response_mask=torch.cat([pad(o.response_mask, 0) for o, _ in parts]),
        response_lengths=torch.cat([o.response_lengths for o, _ in parts]),
        finish_reasons=np.concatenate([o.finish_reasons for o, _ in parts]),
        log_probs=torch.cat([pad(o.log_probs, 0.0) for o, _ in parts]) if has_log_probs else None,
    )


def rollout_probs_diff(batch: Batch) -> dict:
    """How far the rollout's token probabilities are from the actor's recomputed ones (verl's
    ``training/rollout_probs_diff_*``): large values mean the two forwards disagree."""
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
    """The driver's record of one ``update_actor`` call: the engine's global actor/perf figures;
    an on-policy update's rollout-vs-trainer gap under the names ``rollout_probs_diff`` uses; the
    bypass_mode loss's ``rollout_corr/*`` under verl's names (no ``actor/`` prefix)."""
    reduced = reduce_rank_metrics(per_rank, prefix="actor/")
    for name in ("mean", "max"):
        if f"actor/rollout_probs_diff_{name}" in reduced:
            reduced[ROLLOUT_PROBS_DIFF_PREFIX + name] = reduced.pop(f"actor/rollout_probs_diff_{name}")
    for key in [k for k in reduced if k.startswith("actor/rollout_corr/")]:  # bypass_mode's, verl's names
        reduced[key.removeprefix("actor/")] = reduced.pop(key)
    return {k: v for k, v in reduced.items() if k.startswith(("actor/", "perf/", "training/", "rollout_corr/"))}


def mean_metrics(records: list[dict]) -> dict:
    """Key-wise mean over records (a key missing from a record is averaged over the others)."""
    keys = {k for r in records for k in r}
    return {k: float(np.mean([r[k] for r in records if k in r])) for k in sorted(keys)}


def value_metrics(batch: Batch) -> dict:
    """verl's critic data metrics over the response tokens: mean values and returns, and the
    explained variance 1 - var(returns - values) / (var(returns) + 1e-5) (unbiased variances)."""
    mask = batch[LOSS_MASK_KEY].bool()
    values, returns = batch[VALUES_KEY][mask].double(), batch[RETURNS_KEY][mask].double()
    if values.numel() < 2:
        return {}
    return {
        "critic/values/mean": float(values.mean()),
        RETURNS_PREFIX + "mean": float(returns.mean()),
        "critic/vf_explained_var": float(1.0 - (returns - values).var() / (returns.var() + 1e-5)),
    }


class ActorCriticCheckpoint:
    """What ``trainer.checkpoint`` saves, loads and hashes when there is a critic: the actor's shards
    at the root of ``global_step_N``, the critic's under ``critic/``; one manifest covers both
    (hashed on the actor's ranks)."""

    def __init__(self, actor: ActorRolloutGroup, critic: CriticGroup) -> None:
        self.actor, self.critic = actor, critic

    def save_checkpoint(self, path: str, step: int, extra: dict | None = None) -> None:
        self.actor.save_checkpoint(path, step, extra)
        self.critic.save_checkpoint(os.path.join(path, CRITIC_CHECKPOINT_DIR), step)

    def load_checkpoint(self, path: str) -> None:
        critic_path = os.path.join(path, CRITIC_CHECKPOINT_DIR)
        if not os.path.isdir(critic_path):
            raise checkpoint.CheckpointError(
                f"checkpoint {path!r} has no {CRITIC_CHECKPOINT_DIR}/ directory: it was written without a critic "
                "(algorithm.adv_estimator other than gae); start a PPO run from its weights with "
                "actor_rollout_ref.model.warm_start_path instead"
            )
        self.actor.load_checkpoint(path)
        self.critic.load_checkpoint(critic_path)

    def hash_checkpoint_files(self, path: str, sizes: dict[str, int]) -> list[dict[str, dict]]:
        return self.actor.hash_checkpoint_files(path, sizes)


@contextlib.contextmanager
def _timed(metrics: dict, name: str):
    start = time.perf_counter()
    yield
    metrics[timing_key(name)] = metrics.get(timing_key(name), 0.0) + time.perf_counter() - start


# ---------------------------------------------------------------------- trainer
class GRPOTrainer(DriverBase):
    """Builds data, the actor-rollout worker group and the reward function; ``fit()`` trains."""

    plot_panels = PLOT_PANELS
    console_keys = DEFAULT_RL_KEYS
    worker_cls = ActorRolloutWorker
    trainer_modes: tuple[str, ...] = ("sync",)
    """The ``trainer.v1.trainer_mode`` values this class runs (async modes: trainer/grpo/async_trainer.py)."""
    actor: ActorRolloutGroup
    critic: CriticGroup | None = None
    """The critic's worker group (algorithm.adv_estimator=gae), None otherwise."""

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
        self.setup_run(cfg, config=config, model=arr.model)
        self._load_datasets()
        reward = config.custom_reward_function
        self.reward_fn = load_reward_fn(reward.path, reward.name, reward_kwargs=dict(reward.reward_kwargs))
        self.update_cap = a.ppo_max_token_len_per_gpu if a.use_dynamic_bsz else None
        self.log_prob_plans = {"old_log_prob": arr.log_prob_plan("old"), "ref": arr.log_prob_plan("ref")}
        self.updates_per_step = config.updates_per_step
        self.old_log_prob_from_update = config.old_log_prob_from_update
        check_profile_steps(trainer=config.trainer, total_steps=self.total_steps)
        self.policy_loss = a.policy_loss_config()
        algorithm = config.algorithm
        self.kl_ctrl = algorithm.kl_ctrl.controller() if algorithm.use_kl_in_reward else None
        """verl's kl_ctrl_in_reward: the in-reward KL coefficient (driver state, checkpointed)."""
        self.start_workers(
            worker_config=self._worker_config(),
            worker_cls=self.worker_cls,
            description=(
                f"{arr.model.describe(self.model_config)}; {len(self.train_set)} train prompts x n={r.n}, "
                f"{self.total_steps} steps of {self.updates_per_step} optimizer step(s)"
            ),
        )
        try:
            if config.use_critic:
                self.plot_panels = PPO_PLOT_PANELS
                self.critic = self._start_critic()
            self.prepare_workers()
        except BaseException:
            self.close()
            raise

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

    def _worker_config(self) -> ActorRolloutWorkerConfig:
        """The actor-rollout workers' config: the recipe's engine config for the whole run, the
        policy loss, the rollout backend and the tokenizer's special tokens."""
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
            use_reference_policy=config.use_reference_policy,
            **self.export_options(),
        )

    def _critic_worker_config(self) -> CriticWorkerConfig:
        """The critic workers' config: a value model (critic.model.path, or the actor's model) with
        the recipe's critic engine config for the whole run and the value loss's clip."""
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

    def _start_critic(self) -> CriticGroup:
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
        return self.actor if self.critic is None else ActorCriticCheckpoint(self.actor, self.critic)

    def close(self) -> None:
        """Stop the critic's workers too (the actor's and the run directory: ``DriverBase.close``)."""
        try:
            if self.critic is not None:
                cluster.release_group(self.critic)
        finally:
            super().close()

    def restart_workers(self) -> None:
        """A dead worker (actor's or critic's) replaces both groups; both resume from the checkpoint."""
        if self.critic is not None:
            cluster.release_group(self.critic, broken="the old critic group")
            self.critic = self._start_critic()
        super().restart_workers()

    def prepare_workers(self) -> None:
        """Warm start from ``actor_rollout_ref.model.warm_start_path`` and the frozen reference policy
        (KL loss); run on the first worker group and again on one rebuilt after a worker died."""
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
            if self.critic is not None and self.config.critic.model.path is None:
                self._warm_start_critic(path)
        if self.config.use_reference_policy:
            self.actor.sync_reference_policy()

    def _warm_start_critic(self, path: str) -> None:
        """verl's critic.model.path defaults to the actor's, so the critic starts from the actor's
        weights: the warm start's decoder. A LoRA warm start holds only adapters; the critic then
        keeps the base both share."""
        from verl_balance.engine.lora import read_base_fingerprint

        if read_base_fingerprint(path) is not None:
            logger.info("critic warm start: %s holds LoRA adapters only; the critic keeps the base weights", path)
            return
        head = self.critic.load_backbone_weights(path)[0]
        logger.info("critic warm start: decoder%s of %s", " and value head" if head else "", path)

    # ------------------------------------------------------------------ phases
    def generate(self, prompts: tuple[dict, dict], *, n: int, temperature: float, top_p: float, seed: int) -> Batch:
        """Rollout batch (one row per response, prompt-major) with uid/data_source/ground_truth columns."""
        tensors, non_tensors = prompts
        num_prompts = len(non_tensors[PROMPT_IDS_KEY])
        bounds = np.linspace(0, num_prompts, self.world + 1).round().astype(int)
        prompt_batch = Batch.from_dict(
            tensors={PROMPT_LENGTHS_KEY: tensors[ATTENTION_MASK_KEY].sum(1)},
            non_tensors={
                PROMPT_IDS_KEY: non_tensors[PROMPT_IDS_KEY],
                SAMPLE_INDEX_KEY: np.asarray(non_tensors[INDEX_KEY], dtype=np.int64),
            },
        )
        chunks = [prompt_batch.index_select(np.arange(lo, hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]
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
        columns = {UID_KEY: non_tensors[INDEX_KEY]}
        for key in ("data_source", "ground_truth", "extra_info"):
            columns[key] = non_tensors[key]
        return build_rollout_batch(
            prompts=list(non_tensors[PROMPT_IDS_KEY]),
            output=output,
            pad_token_id=self.tokenizer.pad_token_id,
            prompt_columns=columns,
        )

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

    def _mini_batches(self, batch: Batch, *, size: int | None = None) -> list[np.ndarray]:
        """Row indices of each mini-batch: ``size`` (default the actor's ``ppo_mini_batch_size``)
        consecutive prompts, all their responses."""
        prompt_of_row = np.asarray(batch[PROMPT_INDEX_KEY], dtype=np.int64)
        size = size or self.actor_cfg.ppo_mini_batch_size
        num = -(-int(prompt_of_row.max() + 1) // size)
        return [np.flatnonzero(prompt_of_row // size == k) for k in range(num)]

    def train_step(self, prompts: tuple[dict, dict]) -> dict:
        """One GRPO step on one batch of prompts; returns the step's metrics."""
        metrics: dict = {}
        with _timed(metrics, TIMING_STEP):
            if self.config.algorithm.filter_groups.enable:
                batch, scores, extras = self._dynamic_sampling(prompts, metrics)
                pending = self._submit_passes(batch, metrics)
            else:
                batch = self._generate_step(prompts, metrics, seed=self.global_step)
                # The log-prob (and values) passes run on the workers while the driver scores the responses.
                pending = self._submit_passes(batch, metrics)
                with _timed(metrics, TIMING_REWARD):
                    scores, extras = self.score(batch)
            self._dump_rollout(batch, scores, extras)
            baselines = self._greedy_baselines(prompts, batch, metrics)
            self.phase("log-prob passes")
            self._collect_log_prob_passes(batch, pending, metrics)
            with _timed(metrics, TIMING_ADV):
                metrics.update(self._attach_advantages(batch, scores, extras, baselines=baselines))
            if self.critic is not None:
                metrics.update(value_metrics(batch))
                self.phase("critic update")
                with _timed(metrics, TIMING_UPDATE_CRITIC):
                    metrics.update(self.update_critic(batch))
            # verl's trainer.critic_warmup: the actor waits for the critic (0 without one).
            if self.global_step >= self.config.trainer.critic_warmup:
                self.phase("actor update")
                with _timed(metrics, TIMING_UPDATE_ACTOR):
                    metrics.update(self.update_actor(batch))
        metrics.update(self._rollout_metrics(batch, scores, extras))
        tokens = int(batch[ATTENTION_MASK_KEY].sum())
        metrics.update(
            throughput_metrics(tokens=tokens, step_seconds=metrics[timing_key(TIMING_STEP)], num_devices=self.world)
        )
        metrics.update(
            {
                EPOCH_KEY: float(self.loader.epoch),
                "train/old_log_prob_pass": 0.0 if self.old_log_prob_from_update else 1.0,
            }
        )
        return metrics

    def _generate_step(self, prompts: tuple[dict, dict], metrics: dict, *, seed: int) -> Batch:
        """The step's rollout batch (``rollout.n`` responses per prompt) at the sampling temperature;
        with rollout_correction.bypass_mode its old log-probs are the rollout's own."""
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
        if self.config.algorithm.rollout_correction.bypass_mode:
            batch[OLD_LOG_PROBS_KEY] = batch[ROLLOUT_LOG_PROBS_KEY].clone()  # verl's apply_bypass_mode
        return batch

    def _dynamic_sampling(self, prompts: tuple[dict, dict], metrics: dict) -> tuple[Batch, np.ndarray, dict]:
        """DAPO (algorithm.filter_groups, trainer/grpo/dynamic_sampling.py): generate and score batches of
        prompts until ``data.train_batch_size`` of them have responses that differ in the metric."""
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

    def _submit_passes(self, batch: Batch, metrics: dict) -> dict:
        """Start the log-prob passes and (with a critic) the values pass, without waiting."""
        pending = self._submit_log_prob_passes(batch, metrics)
        if self.critic is not None:
            pending[VALUES_KEY] = self._submit_values_pass(batch, metrics)
        return pending

    def _submit_log_prob_passes(self, batch: Batch, metrics: dict) -> dict:
        """Start the old (unless the update takes them from its own forward) and reference
        log-prob passes without waiting; {name: (plan, GroupFuture)}. Each pass is cut by its own
        micro-batching (``log_prob_plans``: rollout.log_prob_*, ref.log_prob_*); passes with the same
        one share the plan. Only the columns a log-prob pass reads travel."""
        passes = {}
        if not self.old_log_prob_from_update and not self.config.algorithm.rollout_correction.bypass_mode:
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

    def _submit_values_pass(self, batch: Batch, metrics: dict) -> tuple:
        """Start the critic's values pass through its own plan (the critic's micro-batching) without
        waiting; (plan, GroupFuture)."""
        c = self.config.critic
        with _timed(metrics, VALUES_KEY):
            plan = self._plan(
                batch,
                micro_batch_size=c.ppo_micro_batch_size_per_gpu,
                token_cap=c.ppo_max_token_len_per_gpu if c.use_dynamic_bsz else None,
            )
            inputs = batch.select(batch_keys=LOG_PROB_INPUT_KEYS, non_tensor_batch_keys=[])
            return plan, self.critic.compute_values.submit(split_by_plan(inputs, plan))

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
        """``advantages`` of ``algorithm.adv_estimator`` (and with gae the critic's ``returns``) from the
        token-level rewards (with use_kl_in_reward, minus the KL penalty), after the decoupled rollout
        correction (``rollout_is_weights``, rejected tokens out of the loss mask); its metrics."""
        algorithm = self.config.algorithm
        rewards, metrics = token_level_rewards(batch, scores=scores, algorithm=algorithm, kl_controller=self.kl_ctrl)
        metrics.update(correct_rollout(batch, algorithm=algorithm))
        out = compute_step_advantages(
            batch, scores=scores, extras=extras, algorithm=algorithm, reward_baselines=baselines, rewards=rewards
        )
        batch[ADVANTAGES_KEY] = out.advantages
        metrics.update(advantage_data_metrics(rewards=rewards, advantages=out.advantages, mask=batch[LOSS_MASK_KEY]))
        if self.critic is not None and out.returns is not None:
            batch[RETURNS_KEY] = out.returns
        return metrics

    def _collect_log_prob_passes(self, batch: Batch, pending: dict, metrics: dict) -> None:
        """Wait for the submitted passes and attach ``old_log_probs`` / ``ref_log_prob`` in row
        order. ``timing_s/old_log_prob`` and ``timing_s/ref`` count the driver's planning (the
        first pass), dispatch and wait after scoring, i.e. the part of each pass that the reward
        computation did not hide."""
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

    def update_actor(self, batch: Batch) -> dict:
        """ppo_epochs x mini-batches optimizer steps; mean actor metrics, plan and measured balance."""
        a = self.actor_cfg
        actor_records, plan_records = [], []
        busy = np.zeros(self.dp)
        on_policy = self.old_log_prob_from_update
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

    def update_critic(self, batch: Batch) -> dict:
        """critic.ppo_epochs x mini-batches value-loss steps, each through its own plan; the mean of
        the critic's global metrics (``critic/vf_loss``, ``vf_clipfrac``, ``vpred_mean``, ``grad_norm``, ``lr``)."""
        c = self.config.critic
        cap = c.ppo_max_token_len_per_gpu if c.use_dynamic_bsz else None
        records = []
        for _ in range(c.ppo_epochs):
            for rows in self._mini_batches(batch, size=c.ppo_mini_batch_size):
                mini = batch.index_select(rows)
                plan = self._plan(mini, micro_batch_size=c.ppo_micro_batch_size_per_gpu, token_cap=cap)
                inputs = mini.select(batch_keys=CRITIC_UPDATE_KEYS, non_tensor_batch_keys=[])
                per_rank = self.critic.update_critic(split_by_plan(inputs, plan))
                reduced = reduce_rank_metrics(per_rank, prefix="critic/")
                records.append({k: v for k, v in reduced.items() if k.startswith("critic/")})
        out = mean_metrics(records)
        out["critic/num_optimizer_steps"] = float(len(records))
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
        """verl's ``trainer.val_before_train``: held-out accuracy of the initial policy at step 0,
        whatever ``test_freq`` says (verl's ``fit``)."""
        if not self.config.trainer.val_before_train:
            return {}
        metrics = self.evaluate()
        tracker.log(metrics, step=0)
        return metrics

    def summarize(self, *, first: dict, last: dict, first_val: dict, last_val: dict) -> dict:
        """First/final train reward and held-out accuracy before/after training."""
        val_key = VAL_ACC_KEY if VAL_ACC_KEY in {**first_val, **last_val} else VAL_REWARD_KEY
        return {
            "algorithm": "PPO" if self.critic is not None else "GRPO",
            "first_reward": first.get(SCORE_MEAN_KEY),
            "final_reward": last.get(SCORE_MEAN_KEY),
            "val_key": val_key,
            "initial_val": first_val.get(val_key),
            "final_val": last_val.get(val_key),
        }

    summary_title = "GRPO"

    @classmethod
    def summary_lines(cls, summary: dict) -> list[str]:
        """Train reward first -> final, and the held-out metric before -> after (``val/acc`` when the
        reward returns ``acc``, else ``val/reward_mean``, named as such)."""
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


__all__ = ["ActorCriticCheckpoint", "GRPOTrainer", "format_summary", "merge_rollout_outputs", "value_metrics"]
