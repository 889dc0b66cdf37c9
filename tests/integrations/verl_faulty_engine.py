"""A deliberately wrong verl backend for negative controls, loaded as ``actor_rollout_ref.model.external_lib``.

``verl_balance_local_token_count`` is the ``verl_balance`` engine normalising each DP rank's loss by
its own loss tokens instead of the DP group's (the classic DP-dependent-loss bug). Test use only.
"""

from __future__ import annotations

from verl.workers.engine.base import EngineRegistry

from verl_balance.integrations.verl.engine import VerlBalanceEngine

BACKEND = "verl_balance_local_token_count"


@EngineRegistry.register(model_type="language_model", backend=BACKEND, device=["cpu", "cuda"])
class LocalTokenCountEngine(VerlBalanceEngine):
    """``verl_balance`` with ``batch_num_tokens`` counted on this rank only (wrong above DP1)."""

    def _global_loss_tokens(self, data) -> float:
        mask = data["loss_mask"] if "loss_mask" in data.keys() else data["response_mask"]
        return float(mask.values().sum() if mask.is_nested else mask.sum())
