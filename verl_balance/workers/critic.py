"""CriticWorker: one Ray actor process = one rank of the value model's engine (PPO's critic).

``ActorWorker``'s engine, dispatch and loss contract with ``model_type="value_model"`` and verl's
clipped value loss; each ``update_critic`` call is one optimizer step. ``update_critic`` reads
loss_mask, ``values`` (old) and ``returns`` besides the model inputs.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from verl_balance.algorithms.value_loss import ValueLoss
from verl_balance.batch_keys import CRITIC_WIRE_KEYS, LOSS_MASK_KEY, RETURNS_KEY, VALUES_KEY
from verl_balance.engine.config import EngineConfigError
from verl_balance.models.value import VALUE_HEAD_NAMES
from verl_balance.protocol import Batch
from verl_balance.single_controller import Dispatch, make_mesh_dispatch, register
from verl_balance.utils import safe_load
from verl_balance.workers.actor import ACTOR_MESH, ActorWorker, ActorWorkerConfig, cat_padded


@dataclass
class CriticWorkerConfig(ActorWorkerConfig):
    """An actor rank's config for the value model: ``engine.model_type`` is set to "value_model"."""

    cliprange_value: float = 0.5
    """verl's ``critic.cliprange_value``: the clip range of the value loss."""

    def __post_init__(self) -> None:
        if self.policy_loss is not None:
            raise EngineConfigError("a critic trains the value loss; policy_loss must be None")
        if self.engine.model_type != "value_model":
            self.engine = dataclasses.replace(self.engine, model_type="value_model")
        if not self.cliprange_value > 0:
            raise EngineConfigError(f"critic.cliprange_value={self.cliprange_value!r} must be > 0")


LM_HEAD_NAMES = ("lm_head.",)
"""A language model's head in an actor checkpoint: the value model has none, so the critic skips it."""


class CriticWarmStartError(ValueError):
    """The critic's warm-start checkpoint does not fit its value model."""


class CriticWorker(ActorWorker):
    """Registered methods: ActorWorker's plus compute_values and update_critic."""

    wire_keys = CRITIC_WIRE_KEYS

    def __init__(self, config: CriticWorkerConfig) -> None:
        if not isinstance(config, CriticWorkerConfig):
            raise TypeError(f"CriticWorker needs a CriticWorkerConfig, got {type(config).__name__}")
        super().__init__(config)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        """Join the process group, build the (dp, sp) mesh and the value model's sharded engine."""
        return super().init_model()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_backbone_weights(self, path: str) -> bool:
        """Load the decoder weights (and a value head, if present) of an engine checkpoint into the
        value model; optimizer state is not restored. Returns whether the head was loaded."""
        metadata = safe_load.read_dcp_metadata(path)  # a planted pickle: UnsafeCheckpointError
        model_sd = get_model_state_dict(self.engine.model)
        has_head = all(f"model.{name}" in metadata.state_dict_metadata for name in VALUE_HEAD_NAMES)
        wanted = {k: v for k, v in model_sd.items() if has_head or k not in VALUE_HEAD_NAMES}
        problems = safe_load.state_mismatch(metadata, wanted, ignore=LM_HEAD_NAMES)
        if problems:
            raise CriticWarmStartError(
                f"critic warm start from actor_rollout_ref.model.warm_start_path={path!r}: it does not fit the "
                f"value model: {'; '.join(problems)}; it must be an engine checkpoint of the actor's architecture"
            )
        state = {"model": wanted}
        safe_load.dcp_load(state, path)
        set_model_state_dict(self.engine.model, state["model"], options=StateDictOptions(strict=False))
        return has_head

    def _loss_fn(self, *, on_policy: bool = False):
        if on_policy:
            raise ValueError("meta 'on_policy' is a PPO policy-loss setting; a critic reads the old values")
        return ValueLoss(cliprange_value=self.config.cliprange_value)

    @register(dispatch_mode=make_mesh_dispatch(ACTOR_MESH))
    def compute_values(self, batch: Batch) -> Batch:
        """Per-token ``values`` (B, L) of this chunk's rows, in row order, aligned like log_probs."""
        outputs = self.engine.compute_values(self._micro_batches(batch))
        return Batch.from_dict(tensors={VALUES_KEY: cat_padded([o[VALUES_KEY] for o in outputs])})

    @register(dispatch_mode=make_mesh_dispatch(ACTOR_MESH))
    def update_critic(self, batch: Batch) -> dict:
        """One optimizer step of the value loss over this DP rank's micro-batches. Returns
        ``vf_loss`` (global J), ``vf_clipfrac``, ``vpred_mean``, ``grad_norm``, ``lr``, timings and ``dp_rank``."""
        missing = [k for k in (LOSS_MASK_KEY, VALUES_KEY, RETURNS_KEY) if k not in batch.tensors.keys()]
        if missing:
            raise ValueError(f"update_critic: the batch lacks columns {missing}; it has {sorted(batch.tensors.keys())}")
        start = time.perf_counter()
        metrics = self.engine.train_batch(self._micro_batches(batch), loss_fn=self._loss_fn())
        metrics["vf_loss"] = metrics.pop("loss")
        metrics["step_seconds"] = time.perf_counter() - start
        metrics["dp_rank"] = self.layout.dp_rank
        return metrics
