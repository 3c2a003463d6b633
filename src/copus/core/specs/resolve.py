"""A model named on the command line or in a config: a preset name or a Hugging Face config.json.

Kept apart from `models.py` (the dataclass and the presets) and `hf_config.py` (the config reader)
so that neither imports the other back.
"""

from __future__ import annotations

from dataclasses import replace

from copus.core.specs.hf_config import load_shape
from copus.core.specs.models import MODELS, ModelShape


def get_model_shape(name: str, seq_len: int | None = None) -> ModelShape:
    """A named shape, or the shape of a Hugging Face config.json (`name` ending in .json,
    `copus.core.specs.hf_config`); `seq_len` (None or 0: the shape's own, 2048 for a config.json)
    replaces the sequence length. ValueError names the bad value and the allowed ones."""
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0):
        raise ValueError(f"seq_len={seq_len!r} is invalid; allowed: an integer >= 1 (0 = the model's own)")
    if name.endswith(".json"):
        return load_shape(name, seq_len or None)
    try:
        shape = MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; allowed: {', '.join(sorted(MODELS))} or a config.json path"
        ) from None
    return replace(shape, seq_len=seq_len) if seq_len else shape
