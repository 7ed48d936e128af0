"""The execute phase's middle: one handler per (source medium, destination medium), and the dispatcher.

``Dispatcher`` runs a job through the handler registered for its media under the byte budget;
gpu_cpu.py wraps a copy engine (transfer/engines/), slab_rows.py restages rows within the CPU slab,
disk_io.py the disk tier's store, remote_io.py the Redis tier (imported on use: redis-py is an optional extra).
"""

from .disk_io import DiskIO
from .dispatch import CopyJob, Dispatcher, WouldBlock
from .gpu_cpu import load_handler, register_engine, store_handler
from .slab_rows import register_slab

__all__ = [
    "CopyJob",
    "DiskIO",
    "Dispatcher",
    "WouldBlock",
    "load_handler",
    "register_engine",
    "register_slab",
    "store_handler",
]
