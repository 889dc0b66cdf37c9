"""verl's ``sft_trainer`` with ``engine.strategy=verl_balance`` and ``hf_model`` in
``checkpoint.save_contents`` writes ``global_step_N/huggingface`` (verl's place) that transformers
loads, and ``python -m verl_balance.export`` exports the same checkpoint without flags: both give
the same logits, which differ from the untrained model's (the directory holds the trained weights).

The trainer is the suite's one real ``torchrun`` launch (the other verl SFT runs use the warm ranks of
``verl_sft_ranks.py``); the export CLI's ``main`` runs in this process with the command's arguments."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("verl")
from tests._chat import write_chat_parquet  # noqa: E402
from verl_balance.testing import forked_workers  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _logits(model_dir: str, ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=ids).logits


def _exit_code(main, argv: list[str]) -> int:
    """The exit status of ``python -m ... *argv`` from the CLI's ``main`` run in this process."""
    try:
        main(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
    return 0


@pytest.mark.slow
def test_verl_sft_trainer_on_our_backend_writes_a_loadable_hf_dir_and_exports_without_flags(tmp_path, model_dir):
    import torch

    from verl_balance.export import main as export_main

    write_chat_parquet(tmp_path / "train.parquet", rows=16)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([REPO, str(tmp_path)]),
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        RAY_ADDRESS="local",
        VERL_USE_EXTERNAL_MODULES="verl_balance.integrations.verl.cpu_shims.platform,verl_balance.integrations.verl.autopatch",
    )
    run_dir = tmp_path / "run"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    trainer = ["-m", "verl.trainer.sft_trainer"]
    if os.environ.get(forked_workers.SOCKET_ENV):  # each rank a fork of the suite's preload server
        launcher, trainer = [*launcher, "--no-python"], forked_workers.python_command(trainer)
    cmd = [
        *launcher,
        *trainer,
        f"data.train_files={tmp_path / 'train.parquet'}",
        "data.train_batch_size=8",
        "data.max_length=256",
        "data.num_workers=0",
        "data.max_token_len_per_gpu=256",
        "data.use_dynamic_bsz=True",
        f"model.path={model_dir}",
        "model.use_remove_padding=False",
        "+model.override_config.attn_implementation=sdpa",
        "engine.strategy=verl_balance",
        "engine._target_=verl_balance.integrations.verl.engine.VerlBalanceEngineConfig",
        "engine.use_torch_compile=False",
        "+engine.mixed_precision.param_dtype=fp32",
        "optim.lr=1e-2",
        "trainer.device=cpu",
        "trainer.logger=[console]",
        "trainer.total_training_steps=2",
        "trainer.total_epochs=1",
        f"trainer.default_local_dir={run_dir}",
        "trainer.save_freq=2",
        "trainer.test_freq=-1",
        "trainer.resume_mode=disable",
        "checkpoint.save_contents=[model,optimizer,extra,hf_model]",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    checkpoints = sorted(p for p in run_dir.rglob("checkpoint_complete.json"))
    assert len(checkpoints) == 1, sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))[:40]
    checkpoint = checkpoints[0].parent
    hf_dir = checkpoint / "huggingface"
    assert (hf_dir / "config.json").is_file() and list(hf_dir.glob("*.safetensors"))
    assert (hf_dir / "tokenizer_config.json").is_file(), "the tokenizer travels with the weights"

    exported = tmp_path / "exported"
    assert _exit_code(export_main, [str(checkpoint), str(exported)]) == 0

    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    from_verl_dir, from_export, untrained = (_logits(str(d), ids) for d in (hf_dir, exported, model_dir))
    torch.testing.assert_close(from_verl_dir, from_export, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(from_verl_dir, untrained, atol=1e-3), "negative control: training changed the weights"
