"""Shared test setup: the repository root is importable without installation."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
VECTORS = SHARED / "vectors"

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
