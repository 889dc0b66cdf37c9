"""The CPU shim makes verl 0.9.1's own device and process-group code run on CPU, loaded only via
``VERL_USE_EXTERNAL_MODULES``; without it the same verl code does not (negative control)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests._verl import VERL_SKIP_REASON
from verl_balance.distributed.launcher import free_port, new_rendezvous

pytest.importorskip("verl", reason=VERL_SKIP_REASON)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIM = "verl_balance.integrations.verl.cpu_shims.platform"

# verl's own code path: device name, backend, engine lookup, then its Ray-style process-group
# initialiser and one collective, on every rank.
RANK_SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    import verl
    from verl.utils.device import get_device_id, get_device_name, get_nccl_backend
    from verl.utils.distributed import initialize_global_process_group_ray
    import verl.workers.engine
    from verl.workers.engine.base import EngineRegistry
    engine = EngineRegistry.get_engine_cls("language_model", "fsdp2").__name__
    initialize_global_process_group_ray()
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    moved = torch.nn.Linear(1, 1).to(get_device_id()).weight.device.type  # verl's module.to(get_device_id())
    print("RESULT", get_device_name(), get_nccl_backend(), dist.get_backend(), engine, int(value.item()), moved)
    dist.destroy_process_group()
    """
)


def _run_ranks(world_size: int, external_modules: str | None) -> list[subprocess.CompletedProcess]:
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        # verl's initialiser reads its init_method here: a file store, which no other process can take
        # between choosing and binding (a free TCP port can be: EADDRINUSE under the parallel suite)
        DIST_INIT_METHOD=new_rendezvous(),
        WORLD_SIZE=str(world_size),
        PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p),
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
    )
    env.pop("VERL_USE_EXTERNAL_MODULES", None)
    env.pop("VERL_PLATFORM", None)
    if external_modules:
        env["VERL_USE_EXTERNAL_MODULES"] = external_modules
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT],
            env=dict(env, RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world_size)
    ]
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


@pytest.mark.slow
def test_verls_device_backend_engine_lookup_and_process_group_run_on_cpu_with_the_shim():
    results = _run_ranks(2, SHIM)
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
        line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT"))
        assert line.split()[1:] == ["cpu", "gloo", "cpu:gloo", "FSDPEngineWithLMHead", "3", "cpu"]  # 1 + 2 summed


@pytest.mark.slow
def test_without_the_shim_verls_process_group_does_not_start_on_cpu_negative_control():
    (result,) = _run_ranks(1, None)
    assert result.returncode != 0 or "RESULT cpu gloo" not in result.stdout


def test_shim_stays_out_of_the_way_when_cuda_is_visible(monkeypatch):
    from verl_balance.integrations.verl.cpu_shims import platform as cpu_platform

    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    monkeypatch.setattr(cpu_platform.torch.cuda, "is_available", lambda: True)
    assert not cpu_platform.wanted()
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    assert cpu_platform.wanted()
