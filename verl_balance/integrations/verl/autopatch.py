"""Import this module to patch verl in the importing process: the target of verl's
``VERL_USE_EXTERNAL_MODULES``, which verl imports inside ``import verl`` in every process (driver
and every Ray worker), unlike ``ray.init(runtime_env=...)`` hooks that a bare ``ray.init()`` loses.

    VERL_USE_EXTERNAL_MODULES=verl_balance.integrations.verl.autopatch python -m verl.trainer.main_ppo ...

The workload comes from ``VERL_BALANCE_WORKLOAD`` (see ``workload.workload_from_env``). verl's
trainer modules are patched when verl imports them (nothing is imported early).
"""

from __future__ import annotations

from verl_balance.integrations.verl.patches.patch import patch_verl

PATCH = patch_verl(import_modules=False)

# Registers the ``verl_balance`` training-engine backend (``engine.strategy=verl_balance``).
import verl_balance.integrations.verl.engine  # noqa: E402,F401
