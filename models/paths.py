"""Where specpipe keeps what it builds and downloads."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$SPECPIPE_CACHE`, else `~/.cache/specpipe`: fixtures, converted
    models, calibrations and the CPU kernel live under it."""
    env = os.environ.get("SPECPIPE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specpipe"
