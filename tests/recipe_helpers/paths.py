"""The repository's root and this helper folder, for tests at any depth under tests/ (instead of
counting ``Path(__file__).parents[N]`` in each file)."""

from __future__ import annotations

from pathlib import Path

HELPERS = Path(__file__).resolve().parent
REPO = HELPERS.parents[1]
