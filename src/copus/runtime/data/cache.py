"""Where copus keeps run-independent caches (BPE tokenizers and encodings, dataset stamps)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """$COPUS_CACHE_DIR, else $XDG_CACHE_HOME/copus, else ~/.cache/copus (run-independent)."""
    if os.environ.get("COPUS_CACHE_DIR"):
        return Path(os.environ["COPUS_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "copus"
