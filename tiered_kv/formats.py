"""The stored tiers' identities and fixed sizes, below the tiers that read and write them.

The config checks a disk's free space against whole records and plans the remote tier's block
count from its values' size, and identity.py names a cache's disk directory and Redis namespace:
all of it from these numbers, which the tiers' own format modules (tiers/disk/format.py,
tiers/remote/format.py, where the encodings live) take from here too.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from .errors import ConfigError

DISK_FORMAT_NAME = "tiered_kv.disk"
DISK_FORMAT_VERSION = 1
ALIGN = 4096  # every disk record starts on a 4 KiB boundary (O_DIRECT; records never share a page)
DISK_HEADER_SIZE = 128  # a disk record's header, before the block's bytes
REMOTE_FORMAT_VERSION = 1
REMOTE_HEADER_SIZE = 80  # a Redis value's header, before the block's bytes


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class DiskNamespace:
    """What a disk directory's blocks mean: blocks from another model, dtype or layout never mix."""

    model_id: str
    dtype: str
    layout_digest: str
    bytes_per_block: int
    key_bytes: int  # 32 (sha256) or 16 (xxh3-128)
    revision: str = ""  # the model revision (weights change -> another namespace)
    shard: str = ""  # the engine's shard, e.g. "tp1of2": ranks never read each other's shards

    def __post_init__(self) -> None:
        for name in ("model_id", "dtype", "layout_digest"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(
                    f"DiskNamespace.{name} must be a non-empty string, got {getattr(self, name)!r}"
                )
        if not isinstance(self.bytes_per_block, int) or self.bytes_per_block <= 0:
            raise ConfigError(
                f"DiskNamespace.bytes_per_block must be a positive int, got {self.bytes_per_block!r}"
            )
        if self.key_bytes not in (16, 32):
            raise ConfigError(f"DiskNamespace.key_bytes must be 16 or 32, got {self.key_bytes!r}")

    def canonical(self) -> dict:
        return {**asdict(self), "format": DISK_FORMAT_NAME, "format_version": DISK_FORMAT_VERSION}

    def dirname(self) -> str:
        blob = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":")).encode()
        return "ns-" + hashlib.sha256(blob).hexdigest()[:20]

    @property
    def record_size(self) -> int:
        return align_up(DISK_HEADER_SIZE + self.bytes_per_block)


def remote_namespace(
    model_id: str,
    revision: str,
    dtype: str,
    layout_digest: str,
    bytes_per_block: int,
    key_bytes: int,
    shard: str,
    tenant_salt: str = "",
) -> str:
    """``ns-<24 hex>``: a hash of everything that decides what a block's bytes mean (and the tenant)."""
    doc = {
        "format": "tiered_kv.remote",
        "version": REMOTE_FORMAT_VERSION,
        "model_id": model_id,
        "revision": revision,
        "dtype": dtype,
        "layout_digest": layout_digest,
        "bytes_per_block": bytes_per_block,
        "key_bytes": key_bytes,
        "shard": shard,
        "tenant": hashlib.sha256(tenant_salt.encode()).hexdigest(),
    }
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return "ns-" + hashlib.sha256(blob).hexdigest()[:24]
