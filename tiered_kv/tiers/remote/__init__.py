"""The remote tier: blocks shared through Redis or Redis Cluster (format, connections, store, residency).

``RemoteStore`` (and ``RemoteResidency``) load on first use, so that config.py can check remote URLs
without importing redis-py, which is an extra (``pip install 'tiered_kv[remote]'``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...formats import remote_namespace
from ...redis_url import redact
from .format import HEADER_SIZE

if TYPE_CHECKING:
    from .residency import RemoteResidency
    from .store import RemoteStore

__all__ = ["HEADER_SIZE", "RemoteResidency", "RemoteStore", "redact", "remote_namespace"]


def __getattr__(name: str) -> Any:
    if name == "RemoteStore":
        from .store import RemoteStore

        return RemoteStore
    if name == "RemoteResidency":
        from .residency import RemoteResidency

        return RemoteResidency
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
