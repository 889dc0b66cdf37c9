"""DriverBase: what every trainer loop on the driver shares — checkpoint, resume, graceful stop.

A subclass sets ``cfg`` (with a ``trainer`` section), ``actor`` (the worker group), ``loader``
(a StatefulDataLoader), ``out_dir`` and ``global_step``. Checkpoints hold the workers' sharded
engine state plus the driver's step and data position, so a resumed run continues the curve
exactly.
"""

from __future__ import annotations

import os

from verl_balance.trainer import common


class DriverBase:
    """Checkpoint/resume and Ctrl-C handling shared by the SFT and GRPO trainers."""

    cfg: object
    actor: object
    loader: object
    out_dir: str
    global_step: int = 0
    _stop_requested: bool = False

    def close(self) -> None:
        """Stop the worker processes and free their placement (the Ray cluster stays up)."""
        self.actor.shutdown()
        self.actor.resource_pool.remove()

    def _trainer_state(self) -> dict:
        return {"global_step": self.global_step, "loader": self.loader.state_dict()}

    def save(self) -> str:
        """Checkpoint workers and driver state as ``global_step_N``; returns its path."""
        path = common.save_trainer_checkpoint(self.actor, root=self.out_dir, step=self.global_step,
                                              trainer_state=self._trainer_state())
        print(f"[checkpoint] saved step {self.global_step} -> {path}", flush=True)
        return path

    def maybe_resume(self) -> None:
        """Honour trainer.resume_mode: auto (latest checkpoint, if any), disable, resume_path."""
        t = self.cfg.trainer
        if t.resume_mode == "disable":
            return
        path = t.resume_from_path if t.resume_mode == "resume_path" else common.latest_checkpoint(self.out_dir)
        if path is None:
            return
        state = common.load_trainer_checkpoint(self.actor, path)
        self.global_step = int(state["global_step"])
        self.loader.load_state_dict(state["loader"])
        common.truncate_metrics_after(os.path.join(self.out_dir, "metrics.jsonl"), self.global_step)
        print(f"[checkpoint] resumed from {path} at step {self.global_step}", flush=True)

    def _request_stop(self, signum, frame) -> None:
        """SIGINT handler: the first Ctrl-C stops after this step (and saves), the second aborts."""
        if self._stop_requested:
            raise KeyboardInterrupt
        self._stop_requested = True
        print("\n[trainer] stop requested: finishing this step, saving a checkpoint, then exiting "
              "(press Ctrl-C again to abort without saving)", flush=True)
