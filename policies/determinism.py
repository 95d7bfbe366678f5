"""Operator determinism declarations (docs/design.md §2, §3).

The declaration is parsed, never inferred: nothing here looks at sampling settings, so
`temperature=0` proves nothing. Accepted spellings are the `Determinism` values with any
letter case, surrounding whitespace, and `-` or spaces in place of `_`. Anything else —
empty, unknown, non-ASCII, not a string — is `unavailable`.
"""

from __future__ import annotations

from schemas.engine import Determinism

_MAX_DECLARATION_CHARS = 64


def normalise_declaration(raw: object) -> str | None:
    """The canonical spelling of `raw`, or None when it cannot be a declaration."""
    if not isinstance(raw, str) or len(raw) > _MAX_DECLARATION_CHARS or not raw.isascii():
        return None
    return raw.strip().lower().replace("-", "_").replace(" ", "_")


def is_recognised_determinism(raw: object) -> bool:
    """True when `raw` names a `Determinism` value (so the governor can warn on typos)."""
    return normalise_declaration(raw) in {d.value for d in Determinism}


def parse_determinism(raw: object) -> Determinism:
    """The declared determinism; unknown, empty or garbage input is `unavailable`."""
    text = normalise_declaration(raw)
    if text is None or not is_recognised_determinism(raw):
        return Determinism.UNAVAILABLE
    return Determinism(text)
