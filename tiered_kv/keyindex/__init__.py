"""Key -> slot index held in numpy arrays (see keytable.py)."""

from __future__ import annotations

from .keytable import KeyTable

__all__ = ["KeyTable"]
