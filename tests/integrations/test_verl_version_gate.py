"""integrations/verl/compat.py: the one version-checked gate to verl's private internals.

- A verl outside ``SUPPORTED_VERL`` gets one line naming the installed and the supported versions,
  from the gate and from ``patch_verl()`` (which then patches nothing); the installed verl and the
  range's edges pass (negative controls).
- No other module of the integration touches a private name of another object (an ``ast`` scan).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from tests._verl import VERL_SKIP_REASON

verl = pytest.importorskip("verl", reason=VERL_SKIP_REASON)

import verl.utils.seqlen_balancing as verl_sb  # noqa: E402

from verl_balance.integrations.verl import compat  # noqa: E402

ROOT = pathlib.Path(compat.__file__).parent
# Private names that are not verl's: peft's LoRA layer switch, our own "already patched" marker.
NOT_VERLS = {"_disable_adapters", "_verl_balance_cpu"}


@pytest.mark.parametrize("version", ["0.9.0", "0.9.1", "0.9.7", "0.10.0.dev0"])
def test_supported_versions_pass(monkeypatch, version):
    monkeypatch.setattr(verl, "__version__", version)
    assert compat.check_verl_version() == version


@pytest.mark.parametrize("version", ["0.8.5", "0.10.0", "1.0.0", "not-a-version"])
def test_an_unsupported_verl_is_one_line_naming_both_versions(monkeypatch, version):
    monkeypatch.setattr(verl, "__version__", version)
    with pytest.raises(compat.VerlVersionError) as info:
        compat.check_verl_version()
    message = str(info.value)
    assert "\n" not in message
    assert f"verl {version} is installed" in message and compat.SUPPORTED_VERL in message
    assert isinstance(info.value, ImportError)
    with pytest.raises(compat.VerlVersionError, match=f"verl {version} is installed"):
        compat.hf_entry_identity()  # every accessor goes through the check


def test_patch_verl_refuses_an_unsupported_verl_before_patching(monkeypatch):
    from verl_balance.integrations.verl import patch_verl

    original = verl_sb.__dict__["get_seqlen_balanced_partitions"]
    monkeypatch.setattr(verl, "__version__", "0.11.0")
    with pytest.raises(compat.VerlVersionError, match=r"verl 0\.11\.0 is installed"):
        patch_verl()
    assert verl_sb.__dict__["get_seqlen_balanced_partitions"] is original
    monkeypatch.setattr(verl, "__version__", "0.9.1")  # negative control: the same call patches
    with patch_verl(balance_trainer=False, import_modules=False):
        assert verl_sb.__dict__["get_seqlen_balanced_partitions"] is not original
    assert verl_sb.__dict__["get_seqlen_balanced_partitions"] is original


def _private_accesses(source: str) -> list[str]:
    """``base._name`` attributes (base not self/cls), ``from verl... import _name`` and ``setattr``
    calls in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = ast.unparse(node.value)
            if base not in ("self", "cls", "handle", "self.handle") and node.attr not in NOT_VERLS:
                found.append(f"{node.lineno}: {base}.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("verl."):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
            found.append(f"{node.lineno}: setattr({ast.unparse(node.args[0])}, ...)")
    return found


def test_only_compat_touches_private_verl_names():
    offenders = {}
    for path in ROOT.rglob("*.py"):
        if path.name != "compat.py":
            hits = _private_accesses(path.read_text())
            if path.name == "platform.py":  # _cpu_device_module fills a module it creates
                hits = [h for h in hits if not h.endswith("setattr(module, ...)")]
            if hits:
                offenders[str(path.relative_to(ROOT))] = hits
    assert not offenders, f"private verl access outside compat.py: {offenders}"


def test_the_scan_sees_each_kind_of_private_access():
    source = (
        "from verl.workers.engine.utils import _hf_entry_identity\n"
        "platform_manager._current_platform = None\n"
        "setattr(EngineRegistry, 'get_engine_cls', f)\n"
        "self._own = 1\n"
    )
    assert _private_accesses(source) == [
        "1: import _hf_entry_identity",
        "2: platform_manager._current_platform",
        "3: setattr(EngineRegistry, ...)",
    ]
