"""Typed errors. Every fault tiered_kv raises is a TieredKVError.

Expected outcomes (a miss, a full tier) are return values, never exceptions.
"""

from __future__ import annotations


class TieredKVError(Exception):
    """Raised for any tiered_kv fault; the base of every error below."""


class ConfigError(TieredKVError, ValueError):
    """Raised when a config is invalid; the message names the dotted key."""


class LayoutError(TieredKVError, ValueError):
    """Raised when KV tensor geometry is inconsistent; the message names the numbers."""


class KeyFormatError(TieredKVError, ValueError):
    """Raised when a block key is not ``bytes`` of the keyer's length (or an upstream id is not 64-bit)."""


class BlockIdError(TieredKVError, ValueError):
    """Raised when GPU block ids are not distinct ints in ``[0, num_blocks)``, or do not match the keys."""


class HintError(TieredKVError, ValueError):
    """Raised when a session hint is not a str or int session id."""


class SlotError(TieredKVError, ValueError):
    """Raised when slot ids given to an index or policy are out of range, repeated, or in the wrong state."""


class TransferError(TieredKVError):
    """Raised when a copy between GPU and CPU fails."""


class DiskError(TieredKVError, OSError):
    """Raised when the disk tier cannot be opened or an I/O fails."""


class TraceError(TieredKVError, ValueError):
    """Raised when a trace file is malformed; the message names the line number."""


class CacheClosedError(TieredKVError, RuntimeError):
    """Raised when a TieredKVCache is used after aclose()."""


class PinningError(TieredKVError, MemoryError):
    """Raised when page-locking the CPU tier is impossible; names the limit to raise."""


class RemoteError(TieredKVError, ConnectionError):
    """Raised when the remote (Redis) tier cannot be reached or set up; names the URL without its password."""
