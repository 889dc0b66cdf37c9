"""verl's own SFT trainer (``verl.trainer.sft_trainer.run_sft``, unmodified) on the warm gloo ranks of
``run_on_ranks``, with the environment torchrun gives its workers.

``torchrun -m verl.trainer.sft_trainer`` starts a launcher and ``nproc`` interpreters that each import
torch, transformers and verl (about 10 s of CPU each here) for a run of a few seconds; the warm ranks
import them once per world size. What differs from torchrun is only the launcher: each rank composes
the Hydra config of ``verl.trainer.sft_trainer.main`` from the same overrides and calls ``run_sft``,
which opens (env://) and destroys verl's process group as under torchrun. What verl imports from
``VERL_USE_EXTERNAL_MODULES`` at ``import verl`` (already imported on a warm rank) is installed
explicitly: the CPU platform, and the autopatch as ``patch_verl`` undone after the run.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os

from verl_balance.distributed.launcher import free_port, new_rendezvous, run_on_ranks


def _sft_rank(
    rank: int, *, world: int, port: int, init_method: str, overrides: tuple[str, ...], cwd: str, env: dict
) -> str | None:
    """One torchrun worker of ``verl.trainer.sft_trainer``; rank 0 returns its console output."""
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        # verl's initialize_global_process_group reads its init_method here: a file store, as in run_on_ranks
        DIST_INIT_METHOD=f"{init_method}?rank={rank}&world_size={world}",
    )
    os.chdir(cwd)
    from verl_balance.integrations.verl.cpu_shims import platform as cpu_platform

    cpu_platform.install()  # before verl's modules that ask for the device on import
    import verl
    from hydra import compose, initialize_config_dir
    from verl.trainer.sft_trainer import run_sft
    from verl.utils.device import auto_set_device

    from verl_balance.integrations.verl import engine  # noqa: F401  (registers the backend)
    from verl_balance.integrations.verl.patches.patch import patch_verl

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name="sft_trainer_engine", overrides=list(overrides))
    console = io.StringIO()
    with contextlib.ExitStack() as stack:
        stack.callback(patch_verl(import_modules=False).undo)
        stack.enter_context(contextlib.redirect_stdout(console))
        auto_set_device(config)
        run_sft(config)
    return console.getvalue() if rank == 0 else None


def run_verl_sft(overrides: list[str], *, nproc: int, cwd: str, timeout_s: float = 600) -> str:
    """``torchrun --nproc_per_node=nproc -m verl.trainer.sft_trainer *overrides`` on warm ranks; rank 0's
    console output (verl's console logger prints ``train/loss:...`` per step there)."""
    env = dict(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", VERL_PLATFORM="cpu", TOKENIZERS_PARALLELISM="false")
    fn = functools.partial(
        _sft_rank,
        world=nproc,
        port=free_port(),
        init_method=new_rendezvous(),
        overrides=tuple(overrides),
        cwd=cwd,
        env=env,
    )
    return run_on_ranks(fn, world=nproc, init_group=False, timeout_s=timeout_s)[0]
