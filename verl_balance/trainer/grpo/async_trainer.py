"""``trainer.v1.trainer_mode=separate_async`` (and ``colocate_async``): GRPO one step off-policy.

``AsyncGRPOTrainer`` is ``GRPOTrainer`` whose batch k was generated ahead, each row recording its
``policy_version``: by a rollout group on its own pool (separate_async; weights synced after each
step) or by the actor group's colocated rollout (colocate_async). Both modes draw the same samples.

Invariants:
- staleness = step - version; ``max_off_policy_strategy=drop`` removes rows staler than
  ``max_off_policy_threshold``, ``wait`` caps the lookahead instead;
- the old log-probs are the rollout's (bypass), unless ``algorithm.rollout_correction`` with
  ``recompute_old_log_prob=always`` keeps the actor's;
- a sample's tokens depend only on its prompt, its seed and the weights, not on the worker;
- a checkpoint keeps the in-flight batches (``async_checkpoint.py``);
- with LoRA, every sync after a rollout group's first sends the adapters only.
No critic (the config refuses gae here).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace

import numpy as np
import ray
import torch
from omegaconf import OmegaConf

from verl_balance.algorithms import rollout_correction as rc
from verl_balance.balance.partition import balanced_partition
from verl_balance.batch_keys import (
    ATTENTION_MASK_KEY,
    INDEX_KEY,
    LOSS_MASK_KEY,
    OLD_LOG_PROBS_KEY,
    POLICY_VERSION_KEY,
    PROMPT_LENGTHS_KEY,
    RESPONSE_LENGTHS_KEY,
    ROLLOUT_LOG_PROBS_KEY,
    TEMPERATURE_KEY,
)
from verl_balance.protocol import Batch
from verl_balance.rollout import RolloutOutput
from verl_balance.single_controller.resource_pool import RayResourcePool, UnplaceableResourcePoolError
from verl_balance.single_controller.worker_group import GroupFuture, RayClassWithInitArgs
from verl_balance.trainer import checkpoint, cluster
from verl_balance.trainer.config.async_mode import MODE_KEY
from verl_balance.trainer.config.sections import TrainerSection
from verl_balance.trainer.grpo.async_checkpoint import (
    EXPECTED_RESPONSE_STATE_KEY,
    IN_FLIGHT_STATE_KEY,
    POLICY_VERSION_STATE_KEY,
    AsyncCheckpoint,
    in_flight_file,
    load_rollout_output,
    save_rollout_output,
)
from verl_balance.trainer.grpo.old_log_probs import OldLogProbs
from verl_balance.trainer.grpo.rollout_batch import merge_rollout_outputs, prompt_batch, rollout_batch
from verl_balance.trainer.grpo.step_metrics import timed as _timed
from verl_balance.trainer.grpo.trainer import GRPOTrainer
from verl_balance.trainer.metrics import (
    EPOCH_KEY,
    TIMING_ADV,
    TIMING_GEN,
    TIMING_REWARD,
    TIMING_STEP,
    TIMING_UPDATE_ACTOR,
    throughput_metrics,
    timing_key,
)
from verl_balance.workers.actor_rollout import sampling_seed
from verl_balance.workers.rollout_group import RolloutGroup
from verl_balance.workers.rollout_worker import RolloutWorker, RolloutWorkerConfig
from verl_balance.workers.weight_sync import DEFAULT_BUCKET_BYTES, AsyncActorRolloutWorker

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------- pure helpers
def peek_loader_item(loader, ahead: int):
    """The item the loader yields ``ahead`` (>= 1) items after its last one, without moving the loader."""
    sampler = loader.sampler
    per_epoch = len(sampler)
    linear = sampler.position + ahead - 1
    epoch, position = sampler.epoch + linear // per_epoch, linear % per_epoch
    order = sampler.epoch_order(epoch)
    indices = order[position * sampler.batch_size : (position + 1) * sampler.batch_size]
    return loader.collate_fn([loader.dataset[int(i)] for i in indices])


def assign_prompts(costs: np.ndarray, *, num_workers: int) -> tuple[list[np.ndarray], dict]:
    """Prompt ids per rollout worker balanced by ``costs``, with its and the contiguous split's predicted imbalance."""
    costs = np.asarray(costs, dtype=np.float64)
    parts = balanced_partition(costs=costs, num_parts=num_workers, equal_size=True)
    bounds = np.linspace(0, len(costs), num_workers + 1).round().astype(int)

    def imbalance(loads) -> float:
        loads = np.asarray(loads, dtype=np.float64)
        return float(loads.max() / loads.mean()) if loads.mean() > 0 else 1.0

    return parts, {
        "rollout/imbalance_predicted": imbalance([costs[p].sum() for p in parts]),
        "rollout/imbalance_predicted_naive": imbalance([costs[a:b].sum() for a, b in zip(bounds[:-1], bounds[1:])]),
    }


def select_output_rows(output: RolloutOutput, rows: np.ndarray) -> RolloutOutput:
    """The rows ``rows`` of a RolloutOutput, in that order."""
    index = torch.as_tensor(rows, dtype=torch.long)
    return RolloutOutput(
        prompt_index=output.prompt_index[rows],
        responses=output.responses[index],
        response_mask=output.response_mask[index],
        response_lengths=output.response_lengths[index],
        finish_reasons=output.finish_reasons[rows],
        log_probs=None if output.log_probs is None else output.log_probs[index],
    )


def merge_assigned_outputs(outputs: list, parts: list[np.ndarray], *, pad_token_id: int) -> RolloutOutput:
    """One prompt-major RolloutOutput from per-worker outputs (worker w's local prompt i is ``parts[w][i]``)."""
    remapped = [
        None if o is None else replace(o, prompt_index=np.asarray(p)[o.prompt_index]) for o, p in zip(outputs, parts)
    ]
    merged = merge_rollout_outputs(remapped, prompt_offsets=[0] * len(parts), pad_token_id=pad_token_id)
    return select_output_rows(merged, np.argsort(merged.prompt_index, kind="stable"))


def add_metrics(metrics: dict, more: dict) -> None:
    """``metrics`` plus ``more``, summing the values of keys both have (two syncs in one step)."""
    for key, value in more.items():
        metrics[key] = metrics.get(key, 0.0) + value


def stale_rows(versions: np.ndarray, *, current: int, threshold: int) -> np.ndarray:
    """Rows whose staleness (current version - the version that generated them) exceeds ``threshold``."""
    return (current - np.asarray(versions)) > threshold


def is_weight_metrics(batch: Batch) -> dict:
    """Token- and sequence-level IS weights exp(log pi_actor - log pi_rollout) of the batch: mean, max, min."""
    mask = batch[LOSS_MASK_KEY].double()
    log_ratio = (batch[OLD_LOG_PROBS_KEY].double() - batch[ROLLOUT_LOG_PROBS_KEY].double()) * mask
    out = {}
    for level in rc.IS_LEVELS:
        config = rc.RolloutCorrectionConfig(rollout_is=level)
        weights = rc.is_weights(log_ratio=log_ratio, loss_mask=mask, config=config)
        values = weights[mask.bool()] if level == "token" else weights[:, 0][mask.sum(1) > 0]
        if values.numel():
            out.update(
                {
                    f"off_policy/is_weight_{level}_mean": float(values.mean()),
                    f"off_policy/is_weight_{level}_max": float(values.max()),
                    f"off_policy/is_weight_{level}_min": float(values.min()),
                }
            )
    return out


class ColocatedFuture:
    """colocate_async: the actor group's ``generate_sequences`` answering as the rollout group's."""

    def __init__(self, future: GroupFuture, version: int) -> None:
        self._future, self._version = future, version

    def get(self) -> list[dict]:
        return [{"output": o, "version": self._version, "busy_s": 0.0} for o in self._future.get()]


@dataclass
class InFlight:
    """A batch whose generation was submitted to the rollout group (or restored from a checkpoint)."""

    prompts: tuple[dict, dict]
    parts: list[np.ndarray]
    future: GroupFuture | ColocatedFuture | None
    version: int
    """The policy version the rollout group generates it with (the last sync submitted before it)."""
    predicted: dict
    answers: list[dict] | None = None
    """The workers' answers once waited for (a restored batch: one answer, its saved output)."""

    def result(self) -> list[dict]:
        """The workers' answers ({"output", "version", "busy_s"} each), waiting for them once."""
        if self.answers is None:
            self.answers = self.future.get()
        return self.answers


# ---------------------------------------------------------------------- trainer
class AsyncGRPOTrainer(GRPOTrainer):
    """GRPO with a separate rollout worker group, generation overlapped with training."""

    trainer_modes = ("separate_async", "colocate_async")
    worker_cls = AsyncActorRolloutWorker
    rollout_group: RolloutGroup | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.v1 = self.config.trainer.v1
        self._in_flight: dict[int, InFlight] = {}
        self._rollout_version: int | None = None
        self._sync_futures: list[GroupFuture] = []
        self._bucket_plans: dict[bool, dict] = {}
        self._rollout_has_base = False
        self._expected_response = float(self.rollout_cfg.response_length)
        self.separate = self.v1.trainer_mode == "separate_async"
        try:
            if self.separate:
                self.rollout_group = self._start_rollout_group()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ rollout group
    def cpu_workers_per_node(self) -> int | None:
        """separate_async: the actor's and the rollout's workers compute at once, and may share a node."""
        if self.config.trainer.v1.trainer_mode != "separate_async":
            return None
        return self.trainer_config.n_gpus_per_node + self.rollout_cfg.n_gpus_per_node

    def _rollout_worker_config(self) -> RolloutWorkerConfig:
        return RolloutWorkerConfig(
            model=self.model_config,
            pad_token_id=self.tokenizer.pad_token_id,
            stop_token_ids=(self.tokenizer.eos_token_id,),
            rollout_max_batch_size=self.rollout_cfg.max_num_seqs,
            rollout_backend=self.config.rollout_backend,
            vllm=self._vllm_config(),
            lora_scaling=self._weight_plan(adapters_only=False)["lora_scaling"],
        )

    def _start_rollout_group(self) -> RolloutGroup:
        """Place nnodes x n_gpus_per_node rollout workers on their own pool and build their engines."""
        r, t = self.rollout_cfg, self.trainer_config
        pool = RayResourcePool(
            n_gpus_per_node=r.n_gpus_per_node,
            nnodes=r.nnodes,
            use_gpu=self.actor.resource_pool.use_gpu,
            cpu_workers_per_node=self.cpu_workers_per_node(),
            placement_timeout_s=t.placement_timeout_s,
        )
        try:
            group = RolloutGroup(
                resource_pool=pool,
                ray_cls_with_init=RayClassWithInitArgs(RolloutWorker, self._rollout_worker_config()),
                call_timeout_s=getattr(t, "worker_call_timeout_s", TrainerSection.worker_call_timeout_s),
                heartbeat_s=getattr(t, "heartbeat_interval_s", TrainerSection.heartbeat_interval_s),
                timeout_hint="trainer.worker_call_timeout_s sets this limit",
            )
        except UnplaceableResourcePoolError as err:
            pool.remove()
            raise cluster.ClusterTooSmallError(
                f"actor_rollout_ref.rollout.nnodes={r.nnodes} x n_gpus_per_node={r.n_gpus_per_node} rollout workers "
                f"do not fit the Ray cluster beside the {self.world} actor workers: {err}. Lower them or use a "
                "larger cluster"
            ) from err
        except BaseException:
            pool.remove()
            raise
        try:
            init_info = group.init_model()
        except BaseException:
            cluster.release_group(group)
            raise
        logger.info(
            "%d rollout workers on their own pool (%s)%s",
            group.world_size,
            MODE_KEY + "=separate_async",
            cluster.describe_rollout_startup(init_info),
        )
        self._rollout_version = None
        self._rollout_has_base = False
        return group

    def close(self) -> None:
        """Stop the rollout workers too."""
        try:
            if self.rollout_group is not None:
                cluster.release_group(self.rollout_group)
                self.rollout_group = None
        finally:
            super().close()

    def restart_workers(self) -> None:
        """A dead worker (actor's or rollout's) replaces every group; in-flight batches are regenerated."""
        self._in_flight.clear()
        self._sync_futures = []
        self._expected_response = float(self.rollout_cfg.response_length)
        if self.rollout_group is not None:
            cluster.release_group(self.rollout_group, broken="the old rollout group")
        if self.separate:
            self.rollout_group = self._start_rollout_group()
        super().restart_workers()

    # ------------------------------------------------------------------ checkpoint
    @property
    def checkpoint_group(self):
        """The actor's shards plus the in-flight batches' rollout outputs (``async_checkpoint``)."""
        return AsyncCheckpoint(self.actor, self._save_in_flight)

    def _trainer_state(self) -> dict:
        """The driver's state plus the policy version, the in-flight batches and the length estimate."""
        return {
            **super()._trainer_state(),
            POLICY_VERSION_STATE_KEY: self.global_step,
            IN_FLIGHT_STATE_KEY: [
                {"step": k, "version": f.version, "file": in_flight_file(k)} for k, f in sorted(self._in_flight.items())
            ],
            EXPECTED_RESPONSE_STATE_KEY: self._expected_response,
        }

    def _save_in_flight(self, path: str) -> None:
        """Wait for every in-flight batch and write its rollout output into the checkpoint ``path``."""
        for step, flight in sorted(self._in_flight.items()):
            output = merge_assigned_outputs(
                [a["output"] for a in flight.result()], flight.parts, pad_token_id=self.tokenizer.pad_token_id
            )
            file = os.path.join(path, in_flight_file(step))
            save_rollout_output(file, output, version=flight.version, predicted=flight.predicted)

    def _load(self, path: str) -> None:
        """Resume: the in-flight batches come back from the checkpoint; the weights go to the rollout group."""
        super()._load(path)
        state = checkpoint.read_json(os.path.join(path, checkpoint.TRAINER_STATE_FILE)) or {}
        self._in_flight = self._restore_in_flight(path, state)
        self._rollout_version = None
        self._expected_response = float(state.get(EXPECTED_RESPONSE_STATE_KEY, self.rollout_cfg.response_length))

    def _restore_in_flight(self, path: str, state: dict) -> dict[int, InFlight]:
        """The in-flight batches a checkpoint saved, their prompts re-read from the restored loader."""
        entries = state.get(IN_FLIGHT_STATE_KEY)
        if entries is None:
            logger.warning(
                "checkpoint %s has no in-flight batches (written with trainer.v1.trainer_mode=sync): batch %d is "
                "generated with the restored weights, one version newer than an uninterrupted run would use",
                path,
                self.global_step,
            )
            return {}
        flights = {}
        for entry in entries:
            step = int(entry["step"])
            output, version, predicted = load_rollout_output(os.path.join(path, in_flight_file(step)))
            if version != int(entry["version"]) or step < self.global_step:
                raise checkpoint.CheckpointError(
                    f"{path}: in-flight batch {step} (policy version {version}) does not match its trainer state "
                    f"{entry} at step {self.global_step}; resume from another global_step_N directory"
                )
            prompts = peek_loader_item(self.loader, step - self.global_step + 1)
            answer = {"output": output, "version": version, "busy_s": 0.0}
            parts = [np.arange(len(prompts[1][INDEX_KEY]))]
            flights[step] = InFlight(prompts, parts, None, version, predicted, answers=[answer])
        return flights

    # ------------------------------------------------------------------ weight sync
    def _weight_plan(self, *, adapters_only: bool) -> dict:
        """The actor's bucket plan (every tensor, or a LoRA actor's adapters only), computed once."""
        if adapters_only not in self._bucket_plans:
            self._bucket_plans[adapters_only] = self.actor.weight_buckets(self.bucket_bytes, adapters_only)[0]
        return self._bucket_plans[adapters_only]

    def sync_weights(self, *, version: int) -> dict:
        """Send the actor's weights to every rollout worker in buckets without waiting; the sync's metrics.
        With LoRA a rollout group that holds the base gets the adapters only."""
        start = time.perf_counter()
        lora = self._weight_plan(adapters_only=False)["lora_scaling"] is not None
        plan = self._weight_plan(adapters_only=lora and self._rollout_has_base)
        buckets = plan["buckets"]
        for i, names in enumerate(buckets):
            bucket = ray.put(self.actor.export_weight_bucket(names)[0])
            self._sync_futures.append(self.rollout_group.receive_weights.submit(bucket, version, i == len(buckets) - 1))
        self._rollout_version = version
        self._rollout_has_base = True
        return {
            "weight_sync/bytes": float(plan["bytes"]),
            "weight_sync/buckets": float(len(buckets)),
            "timing_s/weight_sync": time.perf_counter() - start,
        }

    def _wait_for_sync(self) -> None:
        for future in self._sync_futures:
            future.get()
        self._sync_futures = []

    # ------------------------------------------------------------------ generation
    def _submit(self, prompts: tuple[dict, dict], *, step: int) -> InFlight:
        """Start generating the batch of ``prompts`` (training batch ``step``) on the rollout group."""
        rows = prompt_batch(prompts)
        r = self.rollout_cfg
        costs = r.n * (rows[PROMPT_LENGTHS_KEY].double().numpy() + self._expected_response)
        workers = self.rollout_group.world_size if self.separate else self.world
        parts, predicted = assign_prompts(costs, num_workers=workers)
        sampling = dict(n=r.n, temperature=r.temperature, top_p=r.top_p, max_response_length=r.response_length)
        seed = sampling_seed(self.config.trainer.seed, step)
        chunks = [rows.index_select(p) for p in parts]
        if not self.separate:  # the actor's own rollout, queued before this step's updates
            future = ColocatedFuture(self.actor.generate_sequences.submit(chunks, sampling, seed), self.global_step)
            return InFlight(prompts=prompts, parts=parts, future=future, version=self.global_step, predicted=predicted)
        future = self.rollout_group.generate_sequences.submit(chunks, sampling, seed)
        return InFlight(prompts=prompts, parts=parts, future=future, version=self._rollout_version, predicted=predicted)

    def _submit_ahead(self, step: int) -> None:
        """Keep the batches up to ``step + lookahead`` in flight (never past the run's last step)."""
        for ahead in range(1, self.v1.lookahead + 1):
            target = step + ahead
            if target < self.total_steps and target not in self._in_flight:
                self._in_flight[target] = self._submit(peek_loader_item(self.loader, ahead), step=target)

    def _collect(self, flight: InFlight, metrics: dict) -> Batch:
        """Wait for a submitted batch: the rollout batch (prompt-major) with its policy version."""
        answers = flight.result()
        self._wait_for_sync()
        versions = {a["version"] for a in answers}
        assert versions == {flight.version}, (versions, flight.version)
        output = merge_assigned_outputs(
            [a["output"] for a in answers], flight.parts, pad_token_id=self.tokenizer.pad_token_id
        )
        batch = rollout_batch(flight.prompts, output, pad_token_id=self.tokenizer.pad_token_id)
        batch[POLICY_VERSION_KEY] = torch.full((len(batch),), flight.version, dtype=torch.int64)
        busy = np.array([a["busy_s"] for a in answers])
        metrics.update(flight.predicted)
        metrics["timing_s/rollout_busy_max"] = float(busy.max())
        if busy.mean() > 0:
            metrics["rollout/imbalance_measured"] = float(busy.max() / busy.mean())
        return batch

    # ------------------------------------------------------------------ step
    def old_log_probs(self) -> OldLogProbs:
        """Every update is off-policy; the actor's pass runs with ``recompute_old_log_prob=always``."""
        return OldLogProbs.off_policy(self.config)

    def train_step(self, prompts: tuple[dict, dict]) -> dict:
        """One driver iteration: batch k (generated ahead) trains while the next batches generate; then sync."""
        metrics: dict = {}
        step = self.global_step
        old_log_probs = self.old_log_probs()
        with _timed(metrics, TIMING_STEP):
            if self.separate and self._rollout_version is None:  # a fresh rollout group, or a resumed actor
                add_metrics(metrics, self.sync_weights(version=step))
            flight = self._in_flight.pop(step, None) or self._submit(prompts, step=step)
            self._submit_ahead(step)
            self.phase("rollout")
            with _timed(metrics, TIMING_GEN):
                batch = self._collect(flight, metrics)
            batch = self._apply_sampler(batch, metrics)
            if len(batch):
                self._train_on(batch, metrics, old_log_probs=old_log_probs)
            if self.separate:
                add_metrics(metrics, self.sync_weights(version=step + 1))
        if len(batch):
            metrics.update(self._rollout_metrics(batch, *self._last_scores))
            tokens = int(batch[ATTENTION_MASK_KEY].sum())
            step_seconds = metrics[timing_key(TIMING_STEP)]
            metrics.update(throughput_metrics(tokens=tokens, step_seconds=step_seconds, num_devices=self.world))
            self._expected_response = float(batch[RESPONSE_LENGTHS_KEY].double().mean())
        metrics.update({EPOCH_KEY: float(self.loader.epoch), "train/old_log_prob_pass": float(old_log_probs.recompute)})
        return metrics

    def _apply_sampler(self, batch: Batch, metrics: dict) -> Batch:
        """Staleness statistics (``off_policy/*``); with ``drop`` the batch without its stale rows."""
        versions = batch[POLICY_VERSION_KEY].numpy()
        staleness = self.global_step - versions
        metrics["off_policy/staleness_mean"] = float(staleness.mean())
        metrics["off_policy/staleness_max"] = float(staleness.max())
        metrics["off_policy/policy_version"] = float(self.global_step)
        sampler = self.v1.sampler
        if sampler.max_off_policy_strategy != "drop":
            return batch
        stale = stale_rows(versions, current=self.global_step, threshold=sampler.max_off_policy_threshold)
        metrics["off_policy/dropped_rows"] = float(stale.sum())
        if not stale.any():
            return batch
        logger.warning("step %d: %d rows staler than the sampler's threshold dropped", self.global_step, stale.sum())
        return batch.index_select(np.flatnonzero(~stale))

    def _train_on(self, batch: Batch, metrics: dict, *, old_log_probs: OldLogProbs) -> None:
        """Score, log-probs, advantages and PPO updates against the rollout's log-probs (bypass) or, with the
        decoupled rollout correction, the actor's."""
        batch.meta[TEMPERATURE_KEY] = float(self.rollout_cfg.temperature)
        pending = self._submit_log_prob_passes(batch, metrics, old_log_probs=old_log_probs)
        with _timed(metrics, TIMING_REWARD):
            scores, extras = self.score(batch)
        self._last_scores = (scores, extras)
        self._dump_rollout(batch, scores, extras)
        self.phase("log-prob passes")
        self._collect_log_prob_passes(batch, pending, metrics)
        if OLD_LOG_PROBS_KEY in batch:
            metrics.update(is_weight_metrics(batch))
        if not self.config.algorithm.corrects_rollout:
            batch[OLD_LOG_PROBS_KEY] = batch[ROLLOUT_LOG_PROBS_KEY].clone()  # bypass: the behaviour policy's
        with _timed(metrics, TIMING_ADV):  # decoupled: correct_rollout's weights and rejection, as in sync mode
            metrics.update(self._attach_advantages(batch, scores, extras))
        self.phase("actor update")
        with _timed(metrics, TIMING_UPDATE_ACTOR):
            trained = batch.select(batch_keys=[k for k in batch.tensor_keys if k != POLICY_VERSION_KEY])
            metrics.update(self.train_actor(trained, on_policy=old_log_probs.from_update))


def grpo_trainer_class(cfg) -> type[GRPOTrainer]:
    """The trainer ``trainer.v1.trainer_mode`` asks for (``sync`` and an absent key: GRPOTrainer)."""
    mode = OmegaConf.select(cfg, MODE_KEY, default="sync")
    return AsyncGRPOTrainer if mode in AsyncGRPOTrainer.trainer_modes else GRPOTrainer


__all__ = [
    "AsyncGRPOTrainer",
    "assign_prompts",
    "grpo_trainer_class",
    "is_weight_metrics",
    "merge_assigned_outputs",
    "peek_loader_item",
    "stale_rows",
]
