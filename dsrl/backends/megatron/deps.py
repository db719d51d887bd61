"""The one place that checks megatron-core is importable (every other dsrl.backends.megatron module imports it
lazily)."""

from __future__ import annotations


def require_megatron() -> None:
    """Raise a clear ImportError when megatron-core is missing. Its import-time notices that Transformer Engine and Apex
    are absent (it falls back to torch's optimizers and kernels, which dsrl uses on purpose) are not repeated."""
    import warnings

    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed", category=UserWarning)
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        if exc.name == "triton":  # megatron-core >= 0.18 imports it at import time; a CPU-only torch has none
            raise ImportError(
                "megatron-core >= 0.18 needs triton to be importable (megatron/core/transformer/moe/paged_stash.py "
                "imports it unconditionally) and this torch did not bring it (a CPU-only build): pip install triton"
            ) from exc
        raise ImportError(
            "dsrl.backends.megatron needs megatron-core (0.16.1-0.19.x; 0.17+ needs Python >= 3.12). "
            "Install it with: pip install -e '.[megatron]' (in the dsrl checkout)"
        ) from exc
