"""Imported by data_prep's scripts when they run as files (``python data_prep/dapo.py``), where
``sys.path[0]`` is this folder: puts the repository root on ``sys.path`` so ``data_prep`` imports
as a package. Run as modules (``python -m data_prep.dapo``) they do not need it."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
