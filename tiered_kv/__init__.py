"""tiered_kv: more KV-cache capacity than the GPU holds, for asyncio LLM serving frontends.

KV blocks move from the engine's GPU tensors into pinned CPU slots, spill to a
checksummed disk tier, and come back on a prefix hit. See README.md.
"""

from .config import Config, load_config
from .errors import (
    BlockIdError,
    CacheClosedError,
    ConfigError,
    DiskError,
    KeyFormatError,
    LayoutError,
    PinningError,
    RemoteError,
    TieredKVError,
    TraceError,
    TransferError,
)
from .identity import make_keyer, resolve_geometry, shard_name
from .keys import BlockKeyer, KeyNamespace
from .layout import KVLayout, StorageSpec, plan_regions
from .layout_tensors import TensorSpec
from .manager import LookupResult
from .metrics import CacheMetrics
from .sizes import parse_size

__version__ = "0.1.0"


def __getattr__(name: str):
    # The cache pulls in the transfer engines and the disk tier; import it on first use.
    if name in ("TieredKVCache", "StoreResult"):
        from . import cache

        return getattr(cache, name)
    raise AttributeError(f"module 'tiered_kv' has no attribute {name!r}")


__all__ = [
    "BlockIdError",
    "BlockKeyer",
    "CacheClosedError",
    "CacheMetrics",
    "Config",
    "ConfigError",
    "DiskError",
    "KVLayout",
    "KeyFormatError",
    "KeyNamespace",
    "LayoutError",
    "LookupResult",
    "PinningError",
    "RemoteError",
    "StorageSpec",
    "TensorSpec",
    "StoreResult",
    "TieredKVCache",
    "TieredKVError",
    "TraceError",
    "TransferError",
    "load_config",
    "make_keyer",
    "parse_size",
    "plan_regions",
    "resolve_geometry",
    "shard_name",
]
