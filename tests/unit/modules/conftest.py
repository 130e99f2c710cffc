"""Shared setup of the tests of ``rlcli.modules``.

The float64 references live in ``rl_reference.py`` next to this file; the directory is put on
``sys.path`` here so that the test files can import it whatever pytest's import mode is.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

# Small tensors only: keep the suite fast and deterministic on a couple of CPU cores.
torch.set_num_threads(min(2, torch.get_num_threads()))
