"""Tokenizer loading: the user's tokenizer, or the tiny character-level one shipped with dsrl.

Invariants of :func:`load_tokenizer`: the result always has a pad token (the eos token when the
tokenizer defines none) and ``padding_side == "left"`` (generation appends on the right, so prompts
are left-padded). Nothing is ever downloaded: paths are local directories (or entries already in the
local Hugging Face cache).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from dsrl.config import ConfigError, ModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DSRL_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # dsrl/rl/policy/ -> dsrl/
TINY_TOKENIZER_PATH = os.path.join(DSRL_DIR, "assets", "tiny_tokenizer")


def tokenizer_source(model_cfg: ModelConfig) -> tuple[str, str]:
    """(path, config field it came from): model.tokenizer, else model.path, else the tiny tokenizer."""
    if model_cfg.tokenizer:
        return model_cfg.tokenizer, "dsrl.model.tokenizer"
    if model_cfg.path:
        return model_cfg.path, "dsrl.model.path"
    return TINY_TOKENIZER_PATH, "the built-in tiny tokenizer"


def load_tokenizer(model_cfg: ModelConfig, padding_side: str = "left") -> PreTrainedTokenizerBase:
    """Load the run's tokenizer offline; ensure a pad token and set ``padding_side``.

    Returns a ``transformers.PreTrainedTokenizerBase``. Raises :class:`ConfigError` naming the field
    (``dsrl.model.tokenizer`` or ``dsrl.model.path``) when the tokenizer cannot be loaded, or when it
    has neither a pad nor an eos token.
    """
    from transformers import AutoTokenizer

    path, field_name = tokenizer_source(model_cfg)
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        hint = "" if os.path.isdir(path) else " (no such local directory)"
        raise ConfigError(
            f"{field_name} = {path!r}: cannot load a tokenizer{hint}: {e}. Fix: point it at a local directory "
            "holding tokenizer.json / tokenizer_config.json (dsrl never downloads)."
        ) from e
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ConfigError(
                f"{field_name} = {path!r}: the tokenizer defines neither a pad nor an eos token; dsrl needs one "
                "to pad and to stop generation. Fix: add pad_token/eos_token to its tokenizer_config.json."
            )
        tok.pad_token = tok.eos_token
    tok.padding_side = padding_side
    return tok

