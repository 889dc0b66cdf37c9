"""DriverBase: the set-up both trainers share (layout, tokenizer, model, loader, Ray, worker group)
and the trainer loop every driver shares — steps, validation, tracking, checkpoint, resume and
graceful stop.

A subclass calls ``setup_run`` (layout, run directory, tokenizer, model config, workload model),
builds its datasets, calls ``setup_loader`` and then ``start_workers`` with its worker config;
it implements ``train_step(item)`` and ``evaluate()``; ``summarize`` and ``plot_panels`` shape the
end-of-run summary. Checkpoints hold the workers' sharded engine state plus the driver's step and
data position, so a resumed run continues the curve exactly; each carries the run's identity and
lineage (``checkpoint.py``), and a dead worker can be replaced up to ``trainer.max_restarts`` times
(docs/fault_tolerance.md).
"""

from __future__ import annotations

import logging
import os
import signal
import time

from omegaconf import DictConfig

from verl_balance.data.loader import StatefulDataLoader
from verl_balance.data.tokenizer import Tokenizer, TokenizerError, build_tokenizer
from verl_balance.models.config import ModelConfig
from verl_balance.models.hf import HFModelConfig
from verl_balance.single_controller import WorkerDiedError
from verl_balance.trainer import checkpoint, cluster
from verl_balance.trainer.config import BalanceSection, ConfigError, ModelSection, TrainerSection, record_workload
from verl_balance.utils.tracking import Tracking, plain_config
from verl_balance.workers.actor import ActorWorker, ActorWorkerConfig
from verl_balance.workers.group import ActorGroup

logger = logging.getLogger(__name__)


class DriverBase:
    """Set-up, checkpoint/resume and Ctrl-C handling shared by the SFT and GRPO trainers."""

    cfg: DictConfig
    """The merged Hydra config as given (logged with the run; ``trainer`` keys drive the loop)."""
    actor: ActorGroup
    """The worker group (``workers.group.ActorGroup``: the registered ``ActorWorker`` methods)."""
    loader: StatefulDataLoader
    out_dir: str
    total_steps: int
    global_step: int = 0
    run_identity: checkpoint.RunIdentity | None = None
    _stop_requested: bool = False
    plot_panels: tuple | None = None

    # ------------------------------------------------------------------ set-up
    def setup_run(
        self, cfg: DictConfig, *, trainer: TrainerSection, sp_size: int, model: ModelSection, balance: BalanceSection
    ) -> None:
        """Layout (world, dp, sp), run directory, tokenizer, model config and workload model."""
        self.cfg = cfg
        self.trainer_config = trainer
        self.sp = sp_size
        self.world = trainer.world_size
        self.dp = self.world // self.sp
        self.out_dir = trainer.default_local_dir
        os.makedirs(self.out_dir, exist_ok=True)
        try:
            self.tokenizer: Tokenizer = build_tokenizer(model.tokenizer_path)
        except TokenizerError as err:
            raise ConfigError(f"{model.KEY_PREFIX}tokenizer={model.tokenizer_path!r}: {err}") from err
        self.model_section = model
        self.model_config: ModelConfig | HFModelConfig = model.model_config(vocab_size=self.tokenizer.vocab_size)
        self.workload = balance.workload_for(self.model_config)
        record_workload(self.workload, self.out_dir)
        self.global_step = 0
        self._stop_requested = False

    def setup_loader(self, train_set, *, batch_size: int, shuffle: bool) -> None:
        """The resumable loader over ``train_set`` and the run length in steps."""
        t = self.trainer_config
        self.loader = StatefulDataLoader(
            train_set, batch_size=batch_size, collate_fn=train_set.collate, shuffle=shuffle, seed=t.seed, drop_last=True
        )
        self.total_steps = t.total_training_steps or t.total_epochs * len(self.loader)

    def export_options(self) -> dict:
        """The worker-config fields of ``trainer.save_hf_model`` (the HF export in every checkpoint)."""
        tokenizer = self.model_section.tokenizer_path
        return {
            "save_hf_model": self.trainer_config.save_hf_model,
            "hf_tokenizer_path": os.path.abspath(tokenizer) if os.path.isdir(tokenizer) else None,
        }

    def start_workers(
        self, *, worker_config: ActorWorkerConfig, worker_cls: type = ActorWorker, description: str
    ) -> None:
        """Start (or join) Ray, place the worker group and build the sharded model on it."""
        t = self.trainer_config
        cluster.start_ray(address=t.ray_address, num_workers=self.world)
        use_gpu = cluster.resolve_use_gpu(t.device)
        logger.info(
            "%d %s workers: dp=%d x sp=%d; %s", self.world, "GPU" if use_gpu else "CPU", self.dp, self.sp, description
        )
        self.actor = cluster.build_actor_group(
            worker_config=worker_config, trainer_cfg=t, use_gpu=use_gpu, worker_cls=worker_cls
        )

    @classmethod
    def train(cls, cfg: DictConfig) -> dict:
        """Build the trainer from ``cfg``, fit, and release its workers (also on error); the summary."""
        trainer = cls(cfg)
        try:
            return trainer.fit()
        finally:
            trainer.close()

    # ------------------------------------------------------------------ subclass hooks
    def train_step(self, item) -> dict:
        """One optimizer step (SFT) or one rollout + update round (GRPO) on one loader item."""
        raise NotImplementedError

    def evaluate(self) -> dict:
        """Validation metrics (``val/*``); {} when there is no validation set."""
        raise NotImplementedError

    def before_training(self, tracker: Tracking) -> dict:
        """Metrics logged at step 0 before the first update (none by default)."""
        return {}

    def summarize(self, *, first: dict, last: dict, first_val: dict, last_val: dict) -> dict:
        """Run-specific summary fields from the first/last step and validation metrics."""
        return {}

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict:
        """Train until total steps (or a stop request); returns a summary dict.

        A worker that dies (``WorkerDiedError``) ends the run unless ``trainer.max_restarts`` allows
        a restart: the worker group is rebuilt and training continues from the lineage's newest
        complete checkpoint, the metrics file cut back to that step.
        """
        t = self.cfg.trainer
        self._initial_loader_state = self.loader.state_dict()
        log_file = self._attach_log_file()
        try:
            return self._fit(t)
        finally:
            logging.getLogger().removeHandler(log_file)
            log_file.close()

    def _attach_log_file(self) -> logging.Handler:
        """Log records of the run go to ``<default_local_dir>/<job>.log`` (``main_sft.log`` from the CLI)."""
        name = "train"
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            name = HydraConfig.get().job.name or name
        os.makedirs(self.out_dir, exist_ok=True)
        handler = logging.FileHandler(os.path.join(self.out_dir, f"{name}.log"), encoding="utf-8")
        handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        logging.getLogger().addHandler(handler)
        return handler

    def _fit(self, t) -> dict:
        self.maybe_resume()
        tracker = Tracking(
            t.project_name,
            t.experiment_name,
            log_dir=self.out_dir,
            backends=list(t.logger),
            config=plain_config(self.cfg),
            total_steps=self.total_steps,
        )
        previous_handler = signal.signal(signal.SIGINT, self._request_stop)
        record = {"first": {}, "last": {}, "last_val": {}, "first_val": {}}
        run_start = time.perf_counter()
        restarts, max_restarts, must_restart = 0, self.trainer_config.max_restarts, False
        try:
            while True:
                try:
                    if must_restart:  # inside the try: a worker dying during the restart counts too
                        self.restart_workers()
                        tracker.truncate_after(self.global_step)
                        must_restart = False
                    self._train_loop(tracker, record)
                    break
                except WorkerDiedError as err:
                    if restarts >= max_restarts:
                        raise
                    restarts += 1
                    must_restart = True
                    logger.warning(
                        "a worker died (%s); restart %d of trainer.max_restarts=%d from the last complete checkpoint",
                        err,
                        restarts,
                        max_restarts,
                    )
        finally:
            signal.signal(signal.SIGINT, previous_handler)
            tracker.close()
        summary = {
            "steps": self.global_step,
            "wall_s": time.perf_counter() - run_start,
            "metrics": tracker.metrics_path,
            "restarts": restarts,
            **self.summarize(
                first=record["first"], last=record["last"], first_val=record["first_val"], last_val=record["last_val"]
            ),
        }
        if t.plot:
            from verl_balance.utils.plotting import DEFAULT_PANELS, plot_runs

            summary["plot"] = plot_runs(
                [tracker.metrics_path],
                out=os.path.join(self.out_dir, "curves.png"),
                panels=self.plot_panels or DEFAULT_PANELS,
            )
        return summary

    def _train_loop(self, tracker: Tracking, record: dict) -> None:
        """Steps from ``global_step`` to the end (or a stop request), with validation and saves."""
        t = self.cfg.trainer
        if self.global_step == 0 and not record["first_val"]:
            record["first_val"] = self.before_training(tracker)
        while self.global_step < self.total_steps and not self._stop_requested:
            for item in self.loader:
                metrics = self.train_step(item)
                self.global_step += 1
                record["first"] = record["first"] or metrics
                record["last"] = metrics
                is_last = self.global_step >= self.total_steps
                if t.test_freq > 0 and (self.global_step % t.test_freq == 0 or is_last):
                    record["last_val"] = self.evaluate()
                    metrics.update(record["last_val"])
                tracker.log(metrics, step=self.global_step)
                if t.save_freq > 0 and (self.global_step % t.save_freq == 0 or is_last):
                    self.save()
                if is_last or self._stop_requested:
                    break
        if self._stop_requested and not (t.save_freq > 0 and self.global_step % t.save_freq == 0):
            self.save()

    # ------------------------------------------------------------------ state
    def close(self) -> None:
        """Stop the worker processes and free their placement (the Ray cluster stays up)."""
        self.actor.shutdown()
        self.actor.resource_pool.remove()

    def _trainer_state(self) -> dict:
        # model_config lets ``python -m verl_balance.export CKPT OUT`` rebuild the model without flags.
        return {
            "global_step": self.global_step,
            "loader": self.loader.state_dict(),
            "model_config": {
                "kind": "hf" if isinstance(self.model_config, HFModelConfig) else "builtin",
                **self.model_config.to_dict(),
            },
        }

    def save(self) -> str:
        """Checkpoint workers and driver state as ``global_step_N`` (atomically); returns its path."""
        path = checkpoint.save_trainer_checkpoint(
            self.actor,
            root=self.out_dir,
            step=self.global_step,
            trainer_state=self._trainer_state(),
            identity=self.run_identity,
            max_to_keep=self.trainer_config.max_ckpt_to_keep,
        )
        logger.info("checkpoint: saved step %d -> %s", self.global_step, path)
        return path

    def maybe_resume(self) -> None:
        """Honour trainer.resume_mode (auto: this directory's lineage only; disable; resume_path).

        See ``checkpoint.start_run`` for what each mode does with checkpoints of other runs."""
        t = self.cfg.trainer
        self.run_identity, path = checkpoint.start_run(
            self.out_dir, resume_mode=t.resume_mode, resume_from_path=t.resume_from_path, config=plain_config(self.cfg)
        )
        if path is not None:
            self._load(path)
            logger.info(
                "checkpoint: resumed from %s at step %d (lineage %s, run %s)",
                path,
                self.global_step,
                self.run_identity.lineage_id,
                self.run_identity.run_id,
            )

    def _load(self, path: str) -> None:
        state = checkpoint.load_trainer_checkpoint(self.actor, path)
        self.global_step = int(state["global_step"])
        self.loader.load_state_dict(state["loader"])

    # ------------------------------------------------------------------ restarts
    def prepare_workers(self) -> None:
        """Set-up a freshly built worker group needs before a checkpoint is loaded (e.g. a warm start
        or the reference policy); called after a restart. Nothing by default."""

    def restart_workers(self) -> None:
        """Replace a broken worker group with a new one (same class, config and placement request),
        then continue from this lineage's newest complete checkpoint (or where the lineage began)."""
        old = self.actor
        for release in (old.shutdown, old.resource_pool.remove):
            try:
                release()
            except Exception as err:  # the group is broken already; freeing it is best effort
                logger.warning("restart: releasing the old worker group failed: %s", err)
        init = old.ray_cls_with_init
        self.actor = cluster.build_actor_group(
            worker_config=init.args[0],
            trainer_cfg=self.trainer_config,
            use_gpu=old.resource_pool.use_gpu,
            worker_cls=init.cls,
        )
        self.prepare_workers()
        identity = self.run_identity
        path = checkpoint.latest_checkpoint(self.out_dir, lineage_id=identity.lineage_id) or identity.branch_checkpoint
        if path is not None:
            self._load(path)
        else:
            self.global_step = 0
            self.loader.load_state_dict(self._initial_loader_state)
        logger.warning(
            "restarted the workers; continuing from step %d%s",
            self.global_step,
            f" ({path})" if path else " (no checkpoint yet: from the start)",
        )

    def _request_stop(self, signum, frame) -> None:
        """SIGINT handler: the first Ctrl-C stops after this step (and saves), the second aborts."""
        if self._stop_requested:
            raise KeyboardInterrupt
        self._stop_requested = True
        logger.warning(
            "stop requested: finishing this step, saving a checkpoint, then exiting "
            "(press Ctrl-C again to abort without saving)"
        )
