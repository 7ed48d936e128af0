"""The disk tier: a slot-addressed, checksummed, crash-safe block store on one preallocated file.

Modules: format (on-disk layout), files (trusted files, full writes), records (batched vectored record
I/O), journal + recovery (commit log and its replay), admin (namespace dirs: open, list, gc), store
(DiskStore, the async batch API) and batch_args (its batches' arguments, checked before any I/O).
"""

from .format import DiskNamespace
from .store import DiskStore, RecoveredBlock

__all__ = ["DiskNamespace", "DiskStore", "RecoveredBlock"]
