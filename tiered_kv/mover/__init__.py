"""The async mover: transfer jobs executed per batch, by (source medium, destination medium)."""

from .disk_io import DiskIO
from .gpu_cpu import load_handler, store_handler
from .mover import DIRECTIONS, MEDIA, CopyJob, Mover

__all__ = ["DIRECTIONS", "MEDIA", "CopyJob", "DiskIO", "Mover", "load_handler", "store_handler"]
