"""Loaded by every Python process started with this folder on ``PYTHONPATH`` (the
tensor-parallel tests' worker processes): with ``LMKIT_TEST_TREE_ORACLE`` naming a JSON
file (``truth``, ``tree``, ``path``, ``tests``), plant the truth on the draft trees
there too (:mod:`tree_oracle`)."""

import json
import os
import sys

_spec = os.environ.get("LMKIT_TEST_TREE_ORACLE")
if _spec:
    with open(_spec) as _f:
        _cfg = json.load(_f)
    sys.path.insert(0, _cfg["tests"])
    import tree_oracle

    tree_oracle.plant(_cfg["truth"], _cfg["tree"], _cfg["path"])
