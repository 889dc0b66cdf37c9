"""Old import path of ``VerlActorWorker``; it lives in ``verl_balance.integrations.verl.worker``."""

from verl_balance.integrations.verl.worker import PLANNED_SIZES_KEY, VerlActorWorker, VerlWorkerConfigError

__all__ = ["PLANNED_SIZES_KEY", "VerlActorWorker", "VerlWorkerConfigError"]
