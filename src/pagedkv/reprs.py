"""Short reprs of user-supplied values for error messages.

An error that quotes what the caller sent must stay short and safe to log: a 400-digit
integer or a 1,024-element list is cut to its first characters plus how long it was.
"""

from __future__ import annotations

MAX_REPR_CHARS = 60


def brief(value, limit: int = MAX_REPR_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters (then ``'... (N characters)'``)."""
    text = repr(value) if not isinstance(value, int) or isinstance(value, bool) else _int_repr(value, limit)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _int_repr(value: int, limit: int) -> str:
    """repr of an int, without building a huge decimal (Python refuses > 4,300 digits)."""
    if value.bit_length() > 4 * limit:  # certainly more than ``limit`` decimal digits
        return f"{'-' if value < 0 else ''}an integer of {value.bit_length()} bits"
    return repr(value)
