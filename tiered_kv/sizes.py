"""Human byte sizes: ``512MiB``, ``32GiB``, ``1.5TB`` or a plain integer."""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")

# 1 EiB. No tier is that large; a bigger number is a typo (99999TiB, 1.0e+30) whose slot
# count would overflow the index and the disk format long after the config was accepted.
MAX_SIZE = 1 << 60
_MAX_DIGITS = 40  # bounds the work of parsing a digit string (int() is quadratic in its length)


def _bounded(nbytes: int, given: object) -> int:
    if nbytes > MAX_SIZE:
        shown = "" if given == _magnitude(nbytes) else f"{given} = "
        raise ValueError(f"size {shown}{_magnitude(nbytes)} bytes is over the maximum of 2^60 bytes (1 EiB)")
    return nbytes


def _magnitude(n: int) -> str:
    # str() of a huge int is slow (and refused past 4300 digits): show its power of two instead.
    return str(n) if abs(n) < 10**24 else f"about {'-' if n < 0 else ''}2^{abs(n).bit_length() - 1}"


def parse_size(value: object) -> int:
    """Return ``value`` as a whole number of bytes.

    Raises ValueError (wrapped into ConfigError by the config loader) for
    negatives, booleans, non-finite numbers, unknown units, fractions of a byte
    and sizes over MAX_SIZE (2^60 bytes).
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a size like 512MiB, got boolean {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative, got {_magnitude(value)}")
        return _bounded(value, _magnitude(value))
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0 or value != int(value):
            raise ValueError(f"size must be a non-negative whole number of bytes, got {value!r}")
        return _bounded(int(value), repr(value))
    if not isinstance(value, str):
        raise ValueError(f"expected a size like 512MiB, got {type(value).__name__}")
    match = _SIZE_RE.match(value)
    if not match:
        raise ValueError(f"cannot parse size {value!r} (examples: 4096, 512MiB, 32GiB, 1.5TB)")
    number, unit = match.groups()
    if len(number) > _MAX_DIGITS:
        raise ValueError(f"size {value[:_MAX_DIGITS]!r}... has {len(number)} digits, over the maximum of 2^60 bytes (1 EiB)")
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"unknown size unit {unit!r} in {value!r} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    # Exact arithmetic: "1.5TB" must not pick up float rounding error.
    whole, _, frac = number.partition(".")
    numerator = int((whole or "0") + frac) * factor
    denominator = 10 ** len(frac)
    if numerator % denominator:
        raise ValueError(f"size {value!r} is not a whole number of bytes")
    return _bounded(numerator // denominator, repr(value))


def format_size(nbytes: int) -> str:
    """Binary-unit rendering for reports (``32.0 GiB``)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"  # pragma: no cover
