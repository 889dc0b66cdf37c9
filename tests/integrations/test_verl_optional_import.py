"""Importing the integration must not need verl; using it without verl must say how to install it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


@pytest.mark.slow  # a second interpreter
def test_import_without_verl_succeeds_and_calls_name_the_extra():
    # A child interpreter in which `import verl` fails, whatever this environment has installed.
    script = textwrap.dedent(
        """
        import sys
        sys.modules["verl"] = None  # makes `import verl` raise ImportError
        import verl_balance.integrations.verl as integration
        try:
            integration.patch_verl()
        except ImportError as exc:
            assert "verl-balance[verl]" in str(exc), exc
            print("OK")
        else:
            raise SystemExit("patch_verl() did not raise without verl")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("OK")
