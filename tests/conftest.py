"""Make the repository's top-level packages (models, schemas, ...) importable
when pytest runs from a checkout that is not pip-installed."""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
