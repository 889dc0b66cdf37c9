"""ActorRolloutWorker: the actor rank plus a colocated rollout and an optional frozen reference policy.

Invariants:
- The rollout reads the actor's own weights: before generating, every rank all-gathers the
  unsharded parameters (``TrainEngine.full_state_dict``, a collective over the whole mesh) and
  hands them to its rollout engine (``rollout.build_rollout``) by reference. The gather is redone
  only when the actor took an optimizer step since the last one, so validation and training
  rollouts of one step share it.
- Generation uses its own mesh, ``"rollout"``: every worker is its own DP rank (an SP group does
  not need to generate together), so the driver sends one prompt chunk per worker and gets back one
  ``RolloutOutput`` per worker, in worker-rank order. Because ``full_state_dict`` is collective,
  every worker must join each ``generate_sequences`` call, even with an empty chunk.
- The reference policy is a second, never-updated engine on the same (dp, sp) mesh, so
  ``compute_ref_log_prob`` goes through exactly the packed, sequence-parallel code path of
  ``compute_log_prob``. Its weights are copied from the actor by ``sync_reference_policy`` (the
  trainer does it once, after any warm start and before resuming, so the reference is the initial
  policy of the run).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from verl_balance.batch_keys import PROMPT_IDS_KEY, SAMPLE_INDEX_KEY
from verl_balance.engine.train_engine import TrainEngine
from verl_balance.protocol import Batch
from verl_balance.rollout import RolloutEngine, RolloutOutput, build_rollout
from verl_balance.single_controller import Dispatch, make_mesh_dispatch, register
from verl_balance.workers.actor import ACTOR_MESH, ActorWorker, ActorWorkerConfig, batch_temperature, cat_padded

ROLLOUT_MESH = "rollout"


def sampling_seed(*keys: int) -> int:
    """A 63-bit seed mixed from integer keys, e.g. (trainer seed, step) or (call seed, sample index)."""
    entropy = [int(k) & 0xFFFF_FFFF_FFFF_FFFF for k in keys]
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


class WarmStartError(ValueError):
    """``actor_rollout_ref.model.warm_start_path`` is not a checkpoint this model can load."""


@dataclass
class ActorRolloutWorkerConfig(ActorWorkerConfig):
    """ActorWorkerConfig plus what the rollout and the reference policy need."""

    pad_token_id: int = 0
    """Token id that right-pads responses."""
    stop_token_ids: tuple = ()
    """Token ids that end a response (kept in it, finish reason "stop")."""
    rollout_max_batch_size: int | None = None
    """Sequences decoded together on one worker; None = all of its prompts at once."""
    rollout_backend: str = "auto"
    """The rollout engine (``rollout.factory.ROLLOUT_BACKENDS``; GRPO's actor_rollout_ref.rollout.name)."""
    use_reference_policy: bool = False
    """Build the frozen reference engine (needed for the KL loss)."""


class ActorRolloutWorker(ActorWorker):
    """ActorWorker + ``generate_sequences``, ``compute_ref_log_prob`` and weight-only warm start."""

    def __init__(self, config: ActorRolloutWorkerConfig) -> None:
        super().__init__(config)
        self.rollout: RolloutEngine | None = None
        self.ref_engine: TrainEngine | None = None
        self._rollout_weights_step: int | None = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        """The actor engine, the rollout engine (no weights yet) and, if asked, the reference engine."""
        info = super().init_model()
        self.register_mesh(ROLLOUT_MESH, dp_rank=self.rank, dp_size=self.world_size, is_collect=True)
        # KVCacheRollout for the built-in model, HFRollout for an HF directory (rollout/factory.py).
        self.rollout = build_rollout(
            self.config.model,
            backend=self.config.rollout_backend,
            pad_token_id=self.config.pad_token_id,
            max_batch_size=self.config.rollout_max_batch_size,
            device=self.layout.device,
        )
        if self.config.use_reference_policy:
            self.ref_engine = TrainEngine(
                model_config=self.config.model, engine_config=self.config.engine, layout=self.layout
            )
        return info

    # ------------------------------------------------------------------ weights
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_model_weights(self, path: str) -> None:
        """Load only the model weights of an engine checkpoint (e.g. an SFT ``global_step_N``).

        The optimizer state, schedule and step count of that run are not restored: this starts a
        new run from its weights. DCP reshards, so the checkpoint's worker count may differ.
        """
        state = {"model": get_model_state_dict(self.engine.model)}
        try:
            dcp.load(state, checkpoint_id=path)
        except Exception as err:  # DCP raises several types for missing keys and shape mismatches
            raise WarmStartError(
                f"actor_rollout_ref.model.warm_start_path={path!r} could not be loaded into a model of "
                f"{self.config.model}: {err}"
            ) from err
        set_model_state_dict(self.engine.model, state["model"])
        self._rollout_weights_step = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sync_reference_policy(self) -> None:
        """Copy the actor's current weights into the frozen reference engine (collective)."""
        if self.ref_engine is None:
            raise RuntimeError("the worker was built without a reference policy (use_reference_policy=False)")
        full = self.engine.full_state_dict()
        set_model_state_dict(
            self.ref_engine.model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        )

    def _refresh_rollout_weights(self) -> None:
        step = self.engine.global_step
        if self._rollout_weights_step == step:
            return
        device = self.layout.device
        self.rollout.update_weights({k: v.to(device) for k, v in self.engine.full_state_dict().items()})
        self._rollout_weights_step = step

    # ------------------------------------------------------------------ compute
    @register(dispatch_mode=make_mesh_dispatch(ROLLOUT_MESH))
    def generate_sequences(self, prompts: Batch, sampling: dict, seed: int) -> RolloutOutput | None:
        """Sample ``sampling["n"]`` responses for each of this worker's prompts (None for no prompts).

        ``prompts`` carries the token ids in the non-tensor column ``raw_prompt_ids`` and each
        prompt's global index in ``sample_index``; ``sampling`` holds the ``RolloutEngine.generate``
        keywords other than ``seed`` and ``stop_token_ids``. All prompts go in one batched call in
        which prompt i samples with its own seed ``sampling_seed(seed, sample_index[i])`` (per-row
        random streams, see ``rollout/sampling.py``), so the output is the same on any worker count
        (up to last-bit logit differences between batch shapes; see ``rollout/base.py``).
        """
        self._refresh_rollout_weights()  # collective: before any early return
        if len(prompts) == 0:
            return None
        prompt_ids = [list(p) for p in prompts.non_tensors[PROMPT_IDS_KEY]]
        seeds = [sampling_seed(seed, int(index)) for index in prompts.non_tensors[SAMPLE_INDEX_KEY]]
        return _to_cpu(
            self.rollout.generate(prompt_ids, stop_token_ids=self.config.stop_token_ids, seeds=seeds, **sampling)
        )

    @register(dispatch_mode=make_mesh_dispatch(ACTOR_MESH))
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """Per-token log-probs (B, L) of this chunk's rows under the reference policy."""
        if self.ref_engine is None:
            raise RuntimeError("the worker was built without a reference policy (use_reference_policy=False)")
        outputs = self.ref_engine.compute_log_prob(self._micro_batches(batch), temperature=batch_temperature(batch))
        return Batch.from_dict(tensors={"ref_log_prob": cat_padded([o["log_probs"] for o in outputs])})


def _to_cpu(output: RolloutOutput) -> RolloutOutput:
    return RolloutOutput(
        prompt_index=output.prompt_index,
        responses=output.responses.cpu(),
        response_mask=output.response_mask.cpu(),
        response_lengths=output.response_lengths.cpu(),
        finish_reasons=output.finish_reasons,
        log_probs=None if output.log_probs is None else output.log_probs.cpu(),
    )


__all__ = ["ActorRolloutWorker", "ActorRolloutWorkerConfig", "ROLLOUT_MESH", "WarmStartError", "sampling_seed"]
