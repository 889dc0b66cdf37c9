"""A ``cpu`` platform for verl, so verl's own trainers and workers run on CPU (CI, laptops).

verl 0.9.1 has no CPU platform (it falls back to cuda/nccl, and its process-group backend
``"cpu:gloo,cpu:gloo"`` is rejected by torch). Loaded through
``VERL_USE_EXTERNAL_MODULES=verl_balance.integrations.verl.cpu_shims.platform``, and only where no
accelerator is visible (or ``VERL_PLATFORM=cpu``), it registers and selects ``PlatformCPU`` (device
``cpu``, backend ``gloo``, memory/stream calls no-ops), makes verl's process-group initialisers use
``"cpu:gloo"`` (``install_gloo_backend``) and lets verl's FSDP engines be found for device ``cpu``
(``register_fsdp_engines_for_cpu``). A CI aid, not a performance path.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import types
from datetime import timedelta

import torch

from verl_balance.integrations.verl.compat import engine_registry, replace_attribute, select_platform

logger = logging.getLogger(__name__)

__all__ = ["install", "install_gloo_backend", "platform_class", "register_fsdp_engines_for_cpu"]

CPU_BACKEND = "cpu:gloo"


def _cpu_device_module() -> types.ModuleType:
    """``torch.cpu`` plus the ``torch.cuda`` calls verl makes, as no-ops or zero readings."""
    module = types.ModuleType("verl_balance_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(module, name, getattr(torch.cpu, name))
    noop = lambda *args, **kwargs: None  # noqa: E731
    zero = lambda *args, **kwargs: 0  # noqa: E731
    for name in (
        "empty_cache",
        "ipc_collect",
        "reset_peak_memory_stats",
        "set_per_process_memory_fraction",
        "synchronize",
        "set_device",
    ):
        setattr(module, name, noop)
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(module, name, zero)
    module.manual_seed = torch.manual_seed
    module.manual_seed_all = torch.manual_seed
    module.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    module.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    module.get_device_name = lambda *args, **kwargs: "cpu"
    module.is_available = lambda: True
    module.device_count = lambda: 1

    def mem_get_info(*args, **kwargs):
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        free = os.sysconf("SC_AVPHYS_PAGES") * page_size
        return free, pages * page_size

    module.mem_get_info = mem_get_info
    return module


class _CPUPlatformMethods:
    """The methods of ``PlatformCPU`` (verl's ``PlatformBase`` contract): device ``cpu``, collectives
    over gloo, memory and stream calls as no-ops. Kept apart from verl's base class so that this
    module imports without verl; ``platform_class`` puts the two together."""

    _device_module: types.ModuleType

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return self._device_module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return not torch.cuda.is_available()

    def current_device(self) -> str:
        # verl moves modules and batches to ``get_device_id()``; an index would mean cuda:<index>.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index=None) -> None:
        return None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "VERL_CPU_VISIBLE_DEVICES"

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_resource_options(self, num_gpus: float) -> dict:
        return {}

    def is_ipc_supported(self) -> bool:
        return False

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return None, None

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_noset_envvars(self) -> list[str]:
        return []

    def cudart(self):
        return None


@functools.lru_cache(maxsize=1)
def platform_class() -> type:
    """``PlatformCPU``, a subclass of verl's ``PlatformBase`` (defined on first use: it needs verl)."""
    from verl.plugin.platform.platform_base import PlatformBase

    class PlatformCPU(_CPUPlatformMethods, PlatformBase):
        """verl platform for hosts without an accelerator: device ``cpu``, collectives over gloo."""

        _device_module = _cpu_device_module()

    return PlatformCPU


def wanted() -> bool:
    """True when this process should run verl on CPU: ``VERL_PLATFORM=cpu``, or no CUDA and no override."""
    requested = os.environ.get("VERL_PLATFORM", "").strip().lower()
    return requested == "cpu" or (not requested and not torch.cuda.is_available())


def install_gloo_backend() -> None:
    """Make verl's process-group initialisers use ``"cpu:gloo"`` instead of ``"cpu:gloo,cpu:gloo"``.

    Replaces ``initialize_global_process_group_ray`` (when called without a backend) and
    ``initialize_global_process_group`` in ``verl.utils.distributed`` and in the verl modules that
    imported them by name and are already loaded."""
    import sys

    import verl.utils.distributed as verl_distributed

    original_ray = verl_distributed.initialize_global_process_group_ray
    if getattr(original_ray, "_verl_balance_cpu", False):
        return

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original_ray(timeout_second=timeout_second, backend=backend or CPU_BACKEND)

    def initialize_global_process_group(timeout_second=36000):
        torch.distributed.init_process_group(
            backend=CPU_BACKEND,
            timeout=timedelta(seconds=timeout_second),
            init_method=os.environ.get("DIST_INIT_METHOD", None),
        )
        return int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    initialize_global_process_group_ray._verl_balance_cpu = True
    replacements = {
        "initialize_global_process_group_ray": initialize_global_process_group_ray,
        "initialize_global_process_group": initialize_global_process_group,
    }
    for module in [verl_distributed] + [m for n, m in list(sys.modules.items()) if n.startswith("verl.") and m]:
        for name, replacement in replacements.items():
            if getattr(module, name, None) is getattr(verl_distributed, name):
                replace_attribute(module, name, replacement)


def register_fsdp_engines_for_cpu() -> None:
    """Let ``EngineRegistry`` find verl's FSDP engines (``fsdp``/``fsdp2``, registered for cuda/npu
    only) for device ``cpu``: a lookup for ``cpu`` that finds no cpu entry uses the cuda one."""
    from verl.workers.engine.base import EngineRegistry

    original = EngineRegistry.__dict__["get_engine_cls"].__func__
    if getattr(original, "_verl_balance_cpu", False):
        return

    def get_engine_cls(cls, model_type: str, backend: str):
        registry = engine_registry(cls).get(model_type, {}).get(backend, {})
        if backend in ("fsdp", "fsdp2") and "cpu" not in registry and "cuda" in registry:
            registry["cpu"] = registry["cuda"]
        return original(cls, model_type, backend)

    get_engine_cls._verl_balance_cpu = True
    replace_attribute(EngineRegistry, "get_engine_cls", classmethod(get_engine_cls))


def install() -> bool:
    """Register and select the CPU platform and the gloo backend when ``wanted()``; returns whether it did."""
    if not wanted():
        return False
    from verl.plugin.platform import platform_manager

    platform_cls = platform_class()
    platform_manager.PlatformRegistry.register(platform="cpu")(platform_cls)
    select_platform(platform_cls)
    install_gloo_backend()
    register_fsdp_engines_for_cpu()
    return True


INSTALLED = install()
