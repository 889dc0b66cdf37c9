"""Our single controller without verl: verl is optional and imported by nothing here.

A fresh interpreter where ``import verl`` fails (a meta-path blocker) must import the controller,
split a ``Batch`` by DP_COMPUTE_PROTO, build a pool from verl's positional form, and refuse (not
broadcast) a bare TensorDict it cannot split without verl.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a second interpreter

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_single_controller_works_without_verl():
    # A fresh interpreter where `import verl` fails: dispatch, register and the Ray classes still import and work.
    script = r"""
import sys
class BlockVerl:
    def find_spec(self, name, path=None, target=None):
        if name == "verl" or name.startswith("verl."):
            raise ImportError("verl blocked for this test")
sys.meta_path.insert(0, BlockVerl())
import torch
from verl_balance.protocol import Batch
from verl_balance.single_controller import Dispatch, RayResourcePool, RayWorkerGroup, register
from verl_balance.single_controller.decorator import dispatch_args, get_registration
calls = dispatch_args(Dispatch.DP_COMPUTE_PROTO, (Batch.from_dict(tensors={"x": torch.arange(4)}),), {}, world_size=2)
assert [c[0][0]["x"].tolist() for c in calls] == [[0, 1], [2, 3]]
assert RayResourcePool([2], use_gpu=False).world_size == 2
assert not any(m == "verl" or m.startswith("verl.") for m in sys.modules)
from tensordict import TensorDict
from verl_balance.single_controller import DispatchError
try:
    dispatch_args(Dispatch.DP_COMPUTE_PROTO, (TensorDict({"x": torch.arange(4)}, batch_size=[4]),), {}, world_size=2)
    raise AssertionError("a bare TensorDict was broadcast")
except DispatchError as error:
    assert "bare TensorDict" in str(error)
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
