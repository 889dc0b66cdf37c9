"""The one place that imports verl on demand: ``require_verl`` and its error."""

from __future__ import annotations

INSTALL_HINT = "pip install 'verl-balance[verl]'"


class VerlNotInstalledError(ImportError):
    """verl is not importable; the message says how to install the extra."""


def require_verl():
    """Import and return the ``verl`` package, or raise VerlNotInstalledError."""
    try:
        import verl
    except ImportError as exc:  # pragma: no cover - exercised only without verl
        raise VerlNotInstalledError(
            f"verl_balance.integrations.verl needs verl (0.9.x), which is not importable ({exc}); "
            f"install it with: {INSTALL_HINT}"
        ) from exc
    return verl
