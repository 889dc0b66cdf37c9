"""DriverBase: the set-up both trainers share (layout, tokenizer, model, loader, Ray, worker group)
and the trainer loop every driver shares — steps, validation, tracking, checkpoint, resume and
graceful stop.

A subclass calls ``setup_run``, ``setup_loader`` and ``start_workers``, and implements
``train_step(item)`` and ``evaluate()``. Checkpoints hold the workers' engine state plus the driver's
step and data position, so a resumed run continues the curve exactly (docs/fault_tolerance.md).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import signal
import sys
import time

from omegaconf import DictConfig, OmegaConf

from verl_balance.data.loader import StatefulDataLoader
from verl_balance.data.tokenizer import Tokenizer, TokenizerError, build_tokenizer
from verl_balance.models.config import ModelConfig
from verl_balance.models.hf import HFModelConfig
from verl_balance.single_controller import WorkerDiedError
from verl_balance.trainer import checkpoint, cluster
from verl_balance.trainer.checkpoint.run_lock import RunLock, acquire_run_lock
from verl_balance.trainer.cluster import describe_parameters  # noqa: F401 (the driver's name for it)
from verl_balance.trainer.config.checks import ConfigError
from verl_balance.trainer.config.recipe import RecipeConfig
from verl_balance.trainer.config.sections import ModelSection, TrainerSection, record_workload
from verl_balance.trainer.signals import STOP_SIGNALS, RunInterrupted, interrupt_handlers
from verl_balance.trainer.startup import check_layout_and_device
from verl_balance.trainer.summary import recorded_ends, summary_header
from verl_balance.utils import run_log
from verl_balance.utils.disk import disk_full_text, is_disk_full
from verl_balance.utils.progress import DEFAULT_SFT_KEYS, ProgressDisplay, TimedPhase
from verl_balance.utils.tracking import Tracking, TrackingError, plain_config
from verl_balance.workers.actor import ActorWorker, ActorWorkerConfig
from verl_balance.workers.group import ActorGroup

logger = logging.getLogger(__name__)


class RunDiskFullError(ConfigError):
    """The disk (or quota) of the run directory filled up while the run wrote its files."""


def exit_code(summary: dict) -> int:
    """The entry points' exit status: 0 when finished, 128 + the signal's number after a signal's save (130, 143)."""
    name = summary.get("stop_signal")
    return 0 if name is None else 128 + signal.Signals[name].value


NONFINITE_WATCH_KEYS = (
    "train/loss",
    "train/grad_norm",
    "actor/loss",
    "actor/grad_norm",
    "critic/vf_loss",
    "critic/grad_norm",
)
"""Step metrics whose non-finite value makes a step non-finite (SFT logs train/*, GRPO actor/* and critic/*)."""


def tracking_backends(loggers) -> list[str]:
    """``trainer.logger`` as ``Tracking`` backends (verl's ``file`` is our jsonl)."""
    return list(dict.fromkeys({"file": "jsonl"}.get(name, name) for name in loggers if name != "console"))


class NonFiniteTrainingError(RuntimeError):
    """Training produced trainer.max_consecutive_nonfinite_steps non-finite steps in a row."""


class DriverBase:
    """Set-up, checkpoint/resume and Ctrl-C handling shared by the SFT and GRPO trainers."""

    cfg: DictConfig
    """The merged Hydra config as given (logged with the run and kept in its checkpoints)."""
    config: RecipeConfig
    """The typed recipe (``SFTConfig`` / ``GRPOConfig``)."""
    trainer_config: TrainerSection
    """Its ``trainer`` section: the loop, checkpoints and cluster."""
    actor: ActorGroup
    """The worker group (``workers.group.ActorGroup``: the registered ``ActorWorker`` methods)."""
    loader: StatefulDataLoader
    out_dir: str
    total_steps: int
    global_step: int = 0
    run_identity: checkpoint.RunIdentity | None = None
    _stop_requested: bool = False
    _stop_signal: str | None = None
    """The signal (SIGINT, SIGTERM) that stopped the run after a save; None when it ran to the end."""
    plot_panels: tuple | None = None
    worker_cls: type = ActorWorker
    """The worker class ``start_workers`` places when the subclass names none."""
    _run_lock: RunLock | None = None
    _nonfinite_streak: int = 0
    _nonfinite_total: int = 0
    _last_saved: tuple[int, str] | None = None
    """(step, path) of the newest checkpoint this run saved or loaded."""
    _last_finite_checkpoint: str | None = None
    """The newest checkpoint a finite step ran from (its weights are known to be finite); retention keeps it."""
    _run_log: run_log.RunLog | None = None
    progress: ProgressDisplay | None = None
    """The console's progress display while ``fit`` runs (``trainer.logger`` has ``console``)."""
    console_keys: tuple[str, ...] = DEFAULT_SFT_KEYS
    """The recipe's console metrics when ``trainer.console_metrics`` is null."""

    def __init_subclass__(cls, **kwargs) -> None:
        """A trainer whose ``__init__`` fails releases the run directory at once, not at garbage collection."""
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return

        @functools.wraps(init)
        def init_or_release(self, *args, **kw) -> None:
            try:
                init(self, *args, **kw)
            except BaseException:
                if self._run_lock is not None:
                    self._run_lock.release()
                self._close_run_log()
                raise

        cls.__init__ = init_or_release

    # ------------------------------------------------------------------ set-up
    def setup_run(self, cfg: DictConfig, *, config: RecipeConfig, model: ModelSection) -> None:
        """Layout, run directory, tokenizer, model config and workload model of the typed recipe ``config``."""
        self.cfg = cfg
        self.config = config
        self.trainer_config = trainer = config.trainer
        self.sp = config.sp_size
        self.world = trainer.world_size
        self.dp = config.dp_size
        self.out_dir = trainer.default_local_dir
        # Before anything in the directory is read or written; held until close().
        self._run_lock = acquire_run_lock(self.out_dir)
        self._setup_start = time.perf_counter()
        self._run_log = run_log.attach(os.path.join(self.out_dir, f"{self._job_name()}.log"))
        try:
            self.tokenizer: Tokenizer = build_tokenizer(model.tokenizer_path)
        except TokenizerError as err:
            raise ConfigError(f"{model.KEY_PREFIX}tokenizer={model.tokenizer_path!r}: {err}") from err
        self.model_section = model
        if model.path is None:
            logger.warning(
                "%spath is not set: training the built-in %r model with its byte-level tokenizer; set "
                "%spath=<a Hugging Face model directory> to train your own model",
                model.KEY_PREFIX,
                model.name,
                model.KEY_PREFIX,
            )
        self.model_config: ModelConfig | HFModelConfig = model.model_config(vocab_size=self.tokenizer.vocab_size)
        check_layout_and_device(
            model_config=self.model_config,
            model_key=f"{model.KEY_PREFIX}{'path' if model.path else 'name'}",
            sp_key=config.SP_KEY,
            sp_size=self.sp,
            trainer=trainer,
        )
        self.workload = config.balance.workload_for(self.model_config)
        record_workload(self.workload, self.out_dir)
        self.global_step = 0
        self._stop_requested = False
        self._stop_signal = None
        self._datasets_start = time.perf_counter()

    def setup_loader(self, train_set, *, batch_size: int, shuffle: bool) -> None:
        """The resumable loader over ``train_set`` and the run length in steps."""
        t = self.trainer_config
        logger.info(
            "dataset build (%d train rows): %.1f s",
            len(train_set),
            time.perf_counter() - getattr(self, "_datasets_start", time.perf_counter()),
        )
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
        self, *, worker_config: ActorWorkerConfig, worker_cls: type | None = None, description: str
    ) -> None:
        """Start (or join) Ray, place the worker group and build the sharded model on it."""
        t = self.trainer_config
        with TimedPhase("cluster", "existing Ray cluster" if t.ray_address else "embedded Ray"):
            ray_kwargs = getattr(self.config, "ray_kwargs", None)
            cluster.start_ray(
                address=t.ray_address, num_workers=self.world, ray_init=getattr(ray_kwargs, "ray_init", None)
            )
        use_gpu = cluster.resolve_use_gpu(t.device)
        logger.info(
            "%d %s workers: dp=%d x sp=%d; %s", self.world, "GPU" if use_gpu else "CPU", self.dp, self.sp, description
        )
        # logs the "worker spawn" and "model load" phases
        self.actor = cluster.build_actor_group(
            worker_config=worker_config,
            trainer_cfg=t,
            use_gpu=use_gpu,
            worker_cls=worker_cls or self.worker_cls,
            cpu_workers_per_node=self.cpu_workers_per_node(),
        )

    def cpu_workers_per_node(self) -> int | None:
        """CPU workers of this run's groups computing at once on one node; ``None``: the actor's group alone."""
        return None

    @classmethod
    def train(cls, cfg: DictConfig) -> dict:
        """Build the trainer from ``cfg``, fit, and release its workers (also on error); the summary. A full
        disk is a ``RunDiskFullError`` naming ``trainer.default_local_dir``."""
        try:
            with interrupt_handlers():
                trainer = cls(cfg)
                try:
                    return trainer.fit()
                finally:
                    trainer.close()
        except Exception as err:
            if isinstance(err, (ConfigError, TrackingError)) or not is_disk_full(err):
                raise  # a checkpoint's or the metrics' own disk-full error already names its directory
            directory = OmegaConf.select(cfg, "trainer.default_local_dir", default=None) or "."
            raise RunDiskFullError(f"{disk_full_text('write the run files', directory)} ({err})") from err
        except RunInterrupted as stop:
            print(f"error: {stop}", file=sys.stderr, flush=True)
            raise SystemExit(stop.exit_code) from None

    # ------------------------------------------------------------------ subclass hooks
    def train_step(self, item) -> dict:
        """One driver iteration on one loader item; returns the step's metrics."""
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

    summary_title: str = "run"
    """The end-of-run summary's title (``==== SFT summary ====``)."""

    @classmethod
    def summary_lines(cls, summary: dict) -> list[str]:
        """The recipe's own end-of-run lines, from the fields ``summarize`` added (none by default)."""
        return []

    @classmethod
    def format_summary(cls, summary: dict) -> str:
        """The end-of-run lines: steps and time, the recipe's ``summary_lines``, where the metrics and plot are."""
        lines = summary_header(summary.get("algorithm") or cls.summary_title, summary)
        lines += cls.summary_lines(summary)
        lines.append(f"metrics: {summary['metrics']}")
        if summary.get("plot"):
            lines.append(f"plot: {summary['plot']}")
        return "\n".join(lines)

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict:
        """Train until total steps (or a stop request); returns a summary dict. A dead worker ends the run
        unless ``trainer.max_restarts`` allows a restart from the lineage's newest complete checkpoint."""
        self._initial_loader_state = self.loader.state_dict()
        return self._fit(self.trainer_config)

    @staticmethod
    def _job_name() -> str:
        """The run log's name: Hydra's job name (``main_sft`` from the CLI), else ``train``."""
        from hydra.core.hydra_config import HydraConfig

        return (HydraConfig.get().job.name or "train") if HydraConfig.initialized() else "train"

    def _close_run_log(self) -> None:
        """Close the run log when this driver opened it (the CLI's capture closes its own)."""
        if self._run_log is not None and self._run_log.owned_by_driver:
            self._run_log.close()
        self._run_log = None

    def _fit(self, t) -> dict:
        with TimedPhase("checkpoint verify/resume"):
            self.maybe_resume()
        resumed_from = self.global_step
        tracker = Tracking(
            t.project_name,
            t.experiment_name,
            log_dir=self.out_dir,
            backends=tracking_backends(t.logger),
            config=plain_config(self.cfg),
            total_steps=self.total_steps,
        )
        self._open_progress(t)
        previous = {signum: signal.signal(signum, self._request_stop) for signum in STOP_SIGNALS}
        record = {"first": {}, "last": {}, "last_val": {}, "first_val": {}}
        run_start = time.perf_counter()
        try:
            restarts = self._train_with_restarts(tracker, record)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            tracker.close()
            if self.progress is not None:
                self.progress.close()
        if self._stop_signal is not None and self.global_step >= self.total_steps:
            logger.warning(
                "%s arrived during the last step: the run finished its %d steps and saved them, so it exits with 0 "
                "(docs/fault_tolerance.md, 'Exit codes')",
                self._stop_signal,
                self.total_steps,
            )
            self._stop_signal = None
        if resumed_from:  # the first values are the run's, not this process's
            ends = recorded_ends(tracker.metrics_path)
            record["first"], record["first_val"] = ends["first"], ends["first_val"]
            if not record["last"]:  # no step ran here (the run had finished): its last values are the file's
                record["last"] = ends["last"]
            if not record["last_val"]:
                record["last_val"], record["last_val_step"] = ends["last_val"], ends["last_val_step"]
        summary = {
            "resumed_from_step": resumed_from,
            "steps": self.global_step,
            "total_steps": self.total_steps,
            "val_step": record.get("last_val_step"),
            "wall_s": time.perf_counter() - run_start,
            "startup_s": run_start - getattr(self, "_setup_start", run_start),
            "metrics": tracker.metrics_path,
            "restarts": restarts,
            "stop_signal": self._stop_signal,
            **self.summarize(
                first=record["first"], last=record["last"], first_val=record["first_val"], last_val=record["last_val"]
            ),
        }
        if t.plot:
            summary["plot"] = self._plot(tracker.metrics_path)
        return summary

    def _train_with_restarts(self, tracker: Tracking, record: dict) -> int:
        """``_train_loop``, rebuilding the workers after a ``WorkerDiedError`` up to ``trainer.max_restarts`` times."""
        restarts, max_restarts, must_restart = 0, self.trainer_config.max_restarts, False
        while True:
            try:
                if must_restart:  # inside the try: a worker dying during the restart counts too
                    self.restart_workers()
                    tracker.truncate_after(self.global_step)
                    must_restart = False
                self._train_loop(tracker, record)
                return restarts
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

    def _open_progress(self, t) -> None:
        """The console's progress display (``trainer.logger`` has ``console``)."""
        if "console" in t.logger:
            self.progress = ProgressDisplay(
                total_steps=self.total_steps,
                start_step=self.global_step,
                keys=t.console_metrics or self.console_keys,
                interval_s=t.progress_interval_s,
            )

    def _plot(self, metrics_path: str) -> str:
        """``curves.png`` of the run's metrics in its directory; returns its path."""
        from verl_balance.utils.plotting import DEFAULT_PANELS, plot_runs

        return plot_runs(
            [metrics_path], out=os.path.join(self.out_dir, "curves.png"), panels=self.plot_panels or DEFAULT_PANELS
        )

    def _train_loop(self, tracker: Tracking, record: dict) -> None:
        """Steps from ``global_step`` to the end (or a stop request), with validation and saves."""
        t = self.trainer_config
        if self.global_step == 0 and not record["first_val"]:
            record["first_val"] = self.before_training(tracker)
        saved = False
        while self.global_step < self.total_steps and not self._stop_requested:
            for item in self.loader:
                metrics = self.train_step(item)
                self.global_step += 1
                self._count_nonfinite(metrics)
                record["first"] = record["first"] or metrics
                record["last"] = metrics
                is_last = self.global_step >= self.total_steps
                if t.validate_due(self.global_step, is_last=is_last):
                    record["last_val"] = self.evaluate()
                    record["last_val_step"] = self.global_step
                    metrics.update(record["last_val"])
                tracker.log(metrics, step=self.global_step)
                if self.progress is not None:
                    self.progress.update(self.global_step, metrics)
                self._stop_if_nonfinite_streak(metrics)
                saved = t.save_due(self.global_step, is_last=is_last)
                if saved:
                    self.save()
                if is_last or self._stop_requested:
                    break
        if self._stop_requested and not saved:
            self.save()

    # ------------------------------------------------------------------ state
    def _count_nonfinite(self, metrics: dict) -> None:
        """Track non-finite steps: the streak, and the run's total as ``train/nonfinite_steps``."""
        bad = {k: metrics[k] for k in NONFINITE_WATCH_KEYS if k in metrics and not math.isfinite(metrics[k])}
        if bad:
            self._nonfinite_streak += 1
            self._nonfinite_total += 1
            logger.warning(
                "step %d is non-finite (%s): its optimizer update was skipped and it will not be checkpointed "
                "(%d in a row; trainer.max_consecutive_nonfinite_steps=%d)",
                self.global_step,
                ", ".join(f"{k}={v}" for k, v in bad.items()),
                self._nonfinite_streak,
                self.trainer_config.max_consecutive_nonfinite_steps,
            )
        else:
            self._nonfinite_streak = 0
            if self._last_saved is not None and self._last_saved[0] == self.global_step - 1:
                self._last_finite_checkpoint = self._last_saved[1]
        metrics["train/nonfinite_steps"] = float(self._nonfinite_total)

    def _stop_if_nonfinite_streak(self, metrics: dict) -> None:
        limit = self.trainer_config.max_consecutive_nonfinite_steps
        if self._nonfinite_streak < limit:
            return
        last = self._last_finite_checkpoint
        watched = ", ".join(f"{k}={metrics[k]}" for k in NONFINITE_WATCH_KEYS if k in metrics)
        raise NonFiniteTrainingError(
            f"training stopped at step {self.global_step}: {self._nonfinite_streak} consecutive non-finite steps "
            f"(trainer.max_consecutive_nonfinite_steps={limit}; {watched}). The last checkpoint known to be finite "
            f"(a finite step ran from it) is {last or 'none'}; check the data and optim.lr, then continue from it "
            "(trainer.resume_mode=resume_path trainer.resume_from_path=<it>)"
        )

    def close(self) -> None:
        """Stop the workers, free their placement (Ray stays up) and release the run directory."""
        try:
            cluster.release_group(self.actor)
        finally:
            if self._run_lock is not None:
                self._run_lock.release()
            self._close_run_log()

    def phase(self, name: str) -> None:
        """Show ``name`` as the current phase of the step on the console (a terminal's bar)."""
        if self.progress is not None:
            self.progress.phase(name)

    @property
    def checkpoint_group(self):
        """What a checkpoint saves and restores: the worker group, or an object with the same checkpoint methods."""
        return self.actor

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

    def save(self) -> str | None:
        """Checkpoint as ``global_step_N`` (atomically); returns its path, or None after a non-finite step.
        Retention never deletes the last checkpoint known to be finite."""
        if self._nonfinite_streak:
            logger.warning(
                "checkpoint: step %d is not saved, it is non-finite (%d in a row)",
                self.global_step,
                self._nonfinite_streak,
            )
            return None
        start = time.perf_counter()
        path = checkpoint.save_trainer_checkpoint(
            self.checkpoint_group,
            root=self.out_dir,
            step=self.global_step,
            trainer_state=self._trainer_state(),
            identity=self.run_identity,
            max_to_keep=self.trainer_config.max_ckpt_to_keep,
            protect=self._last_finite_checkpoint,
        )
        self._last_saved = (self.global_step, path)
        logger.info("checkpoint: saved step %d -> %s (%.1f s)", self.global_step, path, time.perf_counter() - start)
        return path

    def maybe_resume(self) -> None:
        """Honour trainer.resume_mode (``checkpoint.start_run``)."""
        t = self.trainer_config
        self.run_identity, path = checkpoint.start_run(
            self.out_dir,
            resume_mode=t.resume_mode,
            resume_from_path=t.resume_from_path,
            config=plain_config(self.cfg),
            schema=type(self.config),
            hasher=checkpoint.group_hasher(self.actor),
            allow_unverified=t.allow_unverified_checkpoint,
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
        state = checkpoint.load_trainer_checkpoint(self.checkpoint_group, path)
        self.global_step = int(state["global_step"])
        self.loader.load_state_dict(state["loader"])
        self._last_saved = (self.global_step, path)

    # ------------------------------------------------------------------ restarts
    def prepare_workers(self) -> None:
        """Set-up a fresh worker group needs before a checkpoint is loaded (also after a restart); none by default."""

    def restart_workers(self) -> None:
        """Replace a broken worker group and continue from this lineage's newest complete checkpoint."""
        old = self.actor
        cluster.release_group(old, broken="the old worker group")
        init = old.ray_cls_with_init
        self.actor = cluster.build_actor_group(
            worker_config=init.args[0],
            trainer_cfg=self.trainer_config,
            use_gpu=old.resource_pool.use_gpu,
            worker_cls=init.cls,
            cpu_workers_per_node=self.cpu_workers_per_node(),
        )
        self.prepare_workers()
        identity = self.run_identity
        path = (
            checkpoint.newest_verified_checkpoint(
                self.out_dir,
                lineage_id=identity.lineage_id,
                hasher=checkpoint.group_hasher(self.actor),
                allow_unverified=self.trainer_config.allow_unverified_checkpoint,
            )
            or identity.branch_checkpoint
        )
        self._nonfinite_streak = 0
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
        """SIGINT / SIGTERM handler: the first stops after this step (and saves), the second aborts."""
        if self._stop_requested:
            raise KeyboardInterrupt
        self._stop_requested = True
        self._stop_signal = signal.Signals(signum).name
        logger.warning(
            "stop requested (%s): finishing this step, saving a checkpoint, then exiting with code %d "
            "(send it again to abort without saving)",
            self._stop_signal,
            128 + signum,
        )
