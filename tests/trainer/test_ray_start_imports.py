"""``trainer/ray_start.py`` imports Ray and the standard library only (its module docstring): a recipe calls
``start_embedded_early`` before its heavy imports, so the cluster's daemons start while torch, tensordict
and the config package import. Checked in a fresh interpreter (this one has them all loaded); the
negative control shows the same check sees torch arrive through a module that does import it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a fresh interpreter per check

HEAVY = ("torch", "tensordict", "transformers", "hydra", "omegaconf")


def _heavy_modules_after(statement: str) -> list[str]:
    probe = f"import json, sys\n{statement}\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_early_start_module_imports_neither_torch_nor_tensordict_nor_the_config():
    assert _heavy_modules_after("import verl_balance.trainer.ray_start") == []


def test_the_import_check_sees_torch_through_a_module_that_imports_it():
    assert _heavy_modules_after("import verl_balance.single_controller.decorator") == ["tensordict", "torch"]
