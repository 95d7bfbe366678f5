"""Small value checks every layer shares (JSON values arrive as Python objects)."""

from __future__ import annotations

from typing import Any, TypeGuard


def is_int(value: Any) -> TypeGuard[int]:
    """An int that is not a bool (JSON `true` parses to a Python bool, an int subclass)."""
    return isinstance(value, int) and not isinstance(value, bool)
