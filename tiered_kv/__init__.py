"""tiered_kv: more KV-cache capacity than the GPU holds, for asyncio LLM serving frontends.

KV blocks move from the engine's GPU tensors into pinned CPU slots, spill to a
checksummed disk tier, and come back on a prefix hit. See README.md.
"""

from importlib import import_module
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Each public name -> the module that defines it, imported on first use: ``import tiered_kv.errors`` (vLLM's
# plugin hook, a CLI's --help) loads neither pydantic nor yaml nor the native core nor torch.
_HOMES = {
    "Config": "config", "load_config": "config",
    "BlockIdError": "errors", "CacheClosedError": "errors", "ConfigError": "errors", "DiskError": "errors",
    "KeyFormatError": "errors", "LayoutError": "errors", "PinningError": "errors", "RemoteError": "errors",
    "TieredKVError": "errors", "TraceError": "errors", "TransferError": "errors",
    "make_keyer": "identity", "resolve_geometry": "identity", "shard_name": "identity",
    "BlockKeyer": "keys", "KeyNamespace": "keys",
    "KVLayout": "layout", "StorageSpec": "layout", "plan_regions": "layout",
    "TensorSpec": "layout_tensors",
    "LookupResult": "manager",
    "CacheMetrics": "metrics",
    "parse_size": "sizes",
    "TieredKVCache": "cache", "StoreResult": "cache",
}  # fmt: skip


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'tiered_kv' has no attribute {name!r}")
    value = getattr(import_module(f".{home}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])


if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, eagerly
    from .cache import StoreResult, TieredKVCache
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
