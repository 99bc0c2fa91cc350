"""`bindings` and `specpipe` import each other (bindings.registry -> specpipe.draft
-> specpipe/__init__ -> specpipe.api -> bindings.kinds); importing `specpipe`
first lets the rest of this folder run. The cycle itself is shown by
`test_imports.py`."""

import specpipe  # noqa: F401
