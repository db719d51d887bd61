"""The one place that checks megatron-core is importable (every other dsrl.backends.megatron module imports it
lazily)."""

from __future__ import annotations


def require_megatron() -> None:
    """Raise a clear ImportError when megatron-core is missing."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "dsrl.backends.megatron needs megatron-core (0.16.1). Install it with: pip install 'dsrl[megatron]'"
        ) from exc
