"""``patch_verl()``: swap our balancer into verl's modules and trainers, reversibly.

Targets: the three ``seqlen_balancing`` functions (in verl's module and every module that imported
them by name), ``get_custom_reward_fn`` (``reward_spelling.py``), the trainers' ``StatefulDataLoader``
(``loader_state.py``) and both trainers' ``_balance_batch``. A target module not imported yet is
imported now (``import_modules=True``) or patched when verl imports it (an import hook).

Invariants: ``undo()`` puts back exactly the objects it replaced (also those patched later by
the hook), removes its hook and is idempotent; patches nest.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from typing import Any

from verl_balance.balance.workload import resolve_workload
from verl_balance.integrations.verl.compat import check_verl_version, replace_attribute
from verl_balance.integrations.verl.patches.loader_state import resumable_loader_class
from verl_balance.integrations.verl.patches.reward_spelling import reward_loader_with_our_spelling
from verl_balance.integrations.verl.patches.seqlen import (
    get_reverse_idx,
    get_seqlen_balanced_partitions,
    rearrange_micro_batches,
)
from verl_balance.integrations.verl.patches.state import PATCH_STATE
from verl_balance.integrations.verl.patches.trainer_balance import balanced_balance_batch, balanced_balance_batch_v1

__all__ = ["FUNCTION_TARGETS", "TRAINER_TARGETS", "VerlPatch", "patch_verl"]

FUNCTION_TARGETS = {
    "verl.utils.seqlen_balancing": ("get_seqlen_balanced_partitions", "rearrange_micro_batches", "get_reverse_idx"),
    "verl.trainer.ppo.ray_trainer": ("get_seqlen_balanced_partitions", "StatefulDataLoader"),
    "verl.trainer.sft_trainer_ray": ("get_seqlen_balanced_partitions", "StatefulDataLoader"),
    "verl.trainer.ppo.v1.trainer_base": ("get_seqlen_balanced_partitions", "StatefulDataLoader"),
    "verl.trainer.sft_trainer": ("StatefulDataLoader",),
    "verl.workers.engine.utils": ("rearrange_micro_batches",),
    "verl.trainer.ppo.reward": ("get_custom_reward_fn",),
}
_REPLACEMENTS = {
    "get_seqlen_balanced_partitions": get_seqlen_balanced_partitions,
    "rearrange_micro_batches": rearrange_micro_batches,
    "get_reverse_idx": get_reverse_idx,
}
# name -> factory of the replacement from verl's original (wrappers rather than drop-ins)
_WRAPPERS = {"get_custom_reward_fn": reward_loader_with_our_spelling, "StatefulDataLoader": resumable_loader_class}
# module -> (class name, method name, replacement)
TRAINER_TARGETS = {
    "verl.trainer.ppo.ray_trainer": ("RayPPOTrainer", "_balance_batch", balanced_balance_batch),
    "verl.trainer.ppo.v1.trainer_base": ("PPOTrainer", "_balance_batch", balanced_balance_batch_v1),
}


class VerlPatch:
    """Handle returned by ``patch_verl``: ``undo()`` (idempotent) or use it as a context manager.
    ``patched``: replaced ``module.attribute`` strings; ``skipped``: target modules that could not
    be imported; ``pending``: those the hook still waits for."""

    def __init__(self, workload, *, balance_trainer: bool) -> None:
        self.patched: list[str] = []
        self.skipped: dict[str, str] = {}
        self.pending: set[str] = set()
        self._saved: list[tuple[Any, str, Any]] = []
        self._previous_workload = PATCH_STATE.workload
        self._workload = workload
        self._balance_trainer = balance_trainer
        self._hook: _PatchOnImport | None = None
        self.active = False

    def _set(self, owner, name: str, value) -> None:
        self._saved.append((owner, name, replace_attribute(owner, name, value)))
        label = f"{owner.__module__}.{owner.__name__}" if isinstance(owner, type) else owner.__name__
        self.patched.append(f"{label}.{name}")

    def _patch_module(self, module) -> None:
        """Apply every target of ``module`` (called now, or by the import hook after it loads)."""
        self.pending.discard(module.__name__)
        for name in FUNCTION_TARGETS.get(module.__name__, ()):
            if name in module.__dict__:
                original = module.__dict__[name]
                self._set(module, name, _WRAPPERS[name](original) if name in _WRAPPERS else _REPLACEMENTS[name])
        if self._balance_trainer and module.__name__ in TRAINER_TARGETS:
            class_name, method, replacement = TRAINER_TARGETS[module.__name__]
            owner = module.__dict__.get(class_name)
            if isinstance(owner, type) and method in owner.__dict__:
                self._set(owner, method, replacement)

    def undo(self) -> None:
        """Restore every replaced attribute to the object it held before this patch."""
        if not self.active:
            return
        if self._hook is not None and self._hook in sys.meta_path:
            sys.meta_path.remove(self._hook)
        for owner, name, original in reversed(self._saved):
            replace_attribute(owner, name, original)
        self._saved.clear()
        PATCH_STATE.workload = self._previous_workload
        if self in PATCH_STATE.stack:
            PATCH_STATE.stack.remove(self)
        self.active = False

    def __enter__(self) -> VerlPatch:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Meta-path finder that patches a pending target module right after it has executed."""

    def __init__(self, handle: VerlPatch) -> None:
        self.handle = handle

    def find_spec(self, fullname, path, target=None):
        """Spec of a pending target with a loader that patches after executing the module."""
        if fullname not in self.handle.pending or not self.handle.active:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader, self.handle)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, handle: VerlPatch) -> None:
        self.loader, self.handle = loader, handle

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        if self.handle.active:
            self.handle._patch_module(module)

    def __getattr__(self, name):  # get_code, get_source, ... for tools that inspect the loader
        return getattr(self.loader, name)


def patch_verl(*, workload=None, balance_trainer: bool = True, import_modules: bool = True) -> VerlPatch:
    """Swap our balancer into verl in this process; returns a handle whose ``undo()`` reverts it.

    ``workload``: None (the ``VERL_BALANCE_WORKLOAD`` default, else verl's own), "tokens", or a
    workload object, used by the DP partition and the micro-batch packer. ``import_modules=False``
    patches only imported modules and hooks the others. For every process set
    ``VERL_USE_EXTERNAL_MODULES=verl_balance.integrations.verl.autopatch``.
    """
    check_verl_version()
    if workload is not None:
        resolve_workload(workload)  # validate early
    handle = VerlPatch(workload, balance_trainer=balance_trainer)
    handle.active = True
    for module_name in FUNCTION_TARGETS.keys() | (TRAINER_TARGETS.keys() if balance_trainer else set()):
        module = sys.modules.get(module_name)
        if module is None and import_modules:
            try:
                module = importlib.import_module(module_name)
            except ImportError as exc:
                handle.skipped[module_name] = str(exc)
                continue
        if module is None:
            handle.pending.add(module_name)
        else:
            handle._patch_module(module)
    if handle.pending:
        handle._hook = _PatchOnImport(handle)
        sys.meta_path.insert(0, handle._hook)
    PATCH_STATE.workload = workload
    PATCH_STATE.stack.append(handle)
    return handle
