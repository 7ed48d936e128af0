"""Key -> slot index held by the native core (see keytable.py)."""

from __future__ import annotations

from .keytable import KeyTable

__all__ = ["KeyTable"]
