"""YAML -> typed config. Every fault is a ConfigError that names the dotted key.

The model section exists so that ``bytes_per_block`` can be planned before any
tensor exists; the CPU and disk slot counts are always
``capacity // bytes_per_block`` of the same layout (see layout.py).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from .core import core
from .errors import ConfigError
from .formats import DISK_HEADER_SIZE, align_up
from .host_checks import SLOT_OVERHEAD_BYTES, disk_room, mem_available
from .policy import GHOST_BYTES_PER_SLOT
from .sizes import MAX_SIZE, format_size, parse_size
from .tier_config import ByteSize, Section, TiersConfig

# Element sizes of the KV dtypes we plan for; the names are torch's.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


# Upper bounds: a value past them is a typo, and each would fail (or allocate for minutes)
# only once a replay or a cache starts, long after check-config said OK.
MAX_SLOTS = core.MAX_SLOTS  # per tier: the native core's int32 positions and links (native/common.hpp)
MAX_GPU_BLOCKS = 2**31
MIN_REPLAY_BLOCK_BYTES = 512  # below this the replay's slot counts explode (64MiB / 1 B = 67M slots)


# The closed sets of names; code elsewhere reads them from here (typing.get_args), never a copy.
PolicyName = Literal["lru", "arc", "window"]
EngineKind = Literal["auto", "host", "cuda"]
KeyHash = Literal["sha256", "xxh3_128"]


# The model_id a config gets when it names none. Blocks are only as trustworthy as the
# namespace they are filed under, so a disk tier (which outlives the process) refuses it.
PLACEHOLDER_MODEL_ID = "demo-model"


class ModelConfig(Section):
    """Geometry of the KV cache: either ``bytes_per_block`` or the full shape."""

    # Must change whenever the weights change: KV computed by other weights is wrong KV.
    model_id: str = Field(PLACEHOLDER_MODEL_ID, min_length=1, max_length=1024)
    revision: str = Field("", max_length=1024)  # e.g. a checkpoint hash; part of every key and of the disk namespace
    allow_placeholder_id: bool = False  # let a disk tier run under the placeholder model_id
    dtype: Literal[tuple(DTYPE_BYTES)] = "float16"  # type: ignore[valid-type]
    block_tokens: int = Field(16, gt=0, le=1 << 20)
    bytes_per_block: ByteSize | None = None
    num_layers: int | None = Field(None, gt=0, le=1 << 12)
    num_kv_heads: int | None = Field(None, gt=0, le=1 << 16)
    head_dim: int | None = Field(None, gt=0, le=1 << 16)
    # 2 for separate K and V tensors per layer, 1 for a fused latent (MLA).
    kv_tensors_per_layer: int = Field(2, gt=0, le=16)

    @model_validator(mode="after")
    def _one_geometry(self) -> ModelConfig:
        shape = (self.num_layers, self.num_kv_heads, self.head_dim)
        if self.bytes_per_block is not None:
            if any(v is not None for v in shape):
                raise ValueError("give either bytes_per_block or num_layers/num_kv_heads/head_dim, not both")
            if self.bytes_per_block <= 0:
                raise ValueError(f"bytes_per_block must be positive, got {self.bytes_per_block}")
        elif any(v is None for v in shape):
            missing = [n for n, v in zip(("num_layers", "num_kv_heads", "head_dim"), shape, strict=True) if v is None]
            raise ValueError(f"missing {', '.join(missing)} (or give bytes_per_block)")
        else:
            regions = self.region_block_bytes()  # at most 4096 layers x 16 tensors, by the field bounds
            if len(regions) * regions[0] > MAX_SIZE:
                raise ValueError(f"one block would be {len(regions) * regions[0]} bytes, over the maximum of 2^60 bytes")
        return self

    def region_block_bytes(self) -> list[int]:
        """Per-region bytes of one block: one region per K/V tensor per layer."""
        if self.bytes_per_block is not None:
            return [self.bytes_per_block]
        per_tensor = self.block_tokens * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]  # type: ignore[operator]
        return [per_tensor] * (self.num_layers * self.kv_tensors_per_layer)  # type: ignore[operator]


_DEVICE_RE = re.compile(r"auto|cpu|cuda(:[0-9]{1,4})?")


class GpuConfig(Section):
    num_blocks: int = Field(1024, gt=0, le=MAX_GPU_BLOCKS)
    device: str = "auto"

    @field_validator("device")
    @classmethod
    def _known_device(cls, device: str) -> str:
        if not _DEVICE_RE.fullmatch(device):
            raise ValueError(f"{device[:64]!r} is not a device; use auto, cpu, cuda or cuda:N")
        return device


class EvictionConfig(Section):
    policy: PolicyName = "lru"
    # Share of the CPU + disk slots that live sessions expecting a follow-up may protect (hints): their
    # blocks outrank every other block until the session ends or idles. 0.9 lets the conversations of a
    # chat service keep almost the whole tier while one-off traffic always keeps a tenth of it.
    protect_share: float = Field(0.9, ge=0, le=1)
    # A protected session with no request for this long loses its protection (it stays live).
    session_idle_s: float = Field(600.0, gt=0)


class TransferConfig(Section):
    engine: EngineKind = "auto"
    max_inflight_bytes: ByteSize = parse_size("256MiB")


class KeysConfig(Section):
    hash: KeyHash = "sha256"
    tenant_salt: str = Field("", max_length=4096)


class ReplayConfig(Section):
    num_requests: int = Field(1200, gt=0, le=1_000_000)
    max_requests: int | None = Field(None, gt=0, le=1 << 40)
    concurrency: int = Field(8, gt=0, le=65536)
    speed: float = Field(0.0, ge=0)  # 0 = as fast as possible, else trace time / speed
    seed: int = Field(0, ge=0, lt=1 << 64)
    block_bytes: ByteSize | None = None  # synthetic block size; overrides model geometry for the replay
    hints: bool = False  # the emulator passes the workload's sessions to the cache as hints
    drop_partial: bool = True  # the emulator never stores a request's partial last block
    instances: int = Field(1, ge=1, le=64)  # serving instances (caches) sharing tiers.remote; > 1 needs it
    route: Literal["round_robin", "session"] = "round_robin"  # how requests reach the instances

    @field_validator("block_bytes")
    @classmethod
    def _not_tiny(cls, block_bytes: int | None) -> int | None:
        if block_bytes is not None and block_bytes < MIN_REPLAY_BLOCK_BYTES:
            raise ValueError(f"{block_bytes} bytes is below the minimum of {MIN_REPLAY_BLOCK_BYTES} bytes")
        return block_bytes


class Config(Section):
    model: ModelConfig = ModelConfig(bytes_per_block=parse_size("256KiB"))
    gpu: GpuConfig = GpuConfig()
    tiers: TiersConfig = TiersConfig()
    eviction: EvictionConfig = EvictionConfig()
    transfer: TransferConfig = TransferConfig()
    keys: KeysConfig = KeysConfig()
    replay: ReplayConfig = ReplayConfig()

    @property
    def bytes_per_block(self) -> int:
        return sum(self.model.region_block_bytes())

    @model_validator(mode="after")
    def _capacities_hold_a_block(self) -> Config:
        check_capacities(self, self.bytes_per_block)
        check_host_resources(self, self.bytes_per_block)
        return self

    @model_validator(mode="after")
    def _disk_needs_a_real_model_id(self) -> Config:
        m = self.model
        if self.tiers.disk.enabled and m.model_id == PLACEHOLDER_MODEL_ID and not m.allow_placeholder_id:
            raise ValueError(
                f"model.model_id: the disk tier outlives this process, so its blocks need the real model id, "
                f"not the placeholder {PLACEHOLDER_MODEL_ID!r}; set model.model_id (and model.revision) to "
                f"values that change whenever the weights change, or set model.allow_placeholder_id: true"
            )
        return self


def check_capacities(cfg: Config, bytes_per_block: int) -> None:
    """Each tier, and the in-flight budget, must hold at least one block of the layout actually used."""
    tiers = [("tiers.cpu.capacity", cfg.tiers.cpu.capacity)]
    if cfg.tiers.disk.enabled:
        tiers.append(("tiers.disk.capacity", cfg.tiers.disk.capacity))
    if cfg.tiers.remote.enabled:
        tiers.append(("tiers.remote.capacity", cfg.tiers.remote.capacity))
    for key, capacity in tiers:
        if capacity < bytes_per_block:
            raise ConfigError(
                f"{key}: {capacity} bytes ({format_size(capacity)}) is smaller than one block "
                f"(bytes_per_block = {bytes_per_block})"
            )
        if capacity // bytes_per_block > MAX_SLOTS:
            raise ConfigError(
                f"{key}: {format_size(capacity)} holds {capacity // bytes_per_block} blocks of {bytes_per_block} bytes, "
                f"over the maximum of {MAX_SLOTS} slots per tier (the native core's MAX_SLOTS)"
            )
    inflight = cfg.transfer.max_inflight_bytes
    if inflight < bytes_per_block:
        raise ConfigError(
            f"transfer.max_inflight_bytes: {inflight} bytes is smaller than one block (bytes_per_block = {bytes_per_block})"
        )


def _shown(part: object) -> str:
    # A key is echoed in a one-line error: escape control characters, cut a huge one short.
    text = str(part)
    return (text if text.isprintable() else repr(text))[:80]


def _format_errors(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(_shown(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        # Cross-section checks already name their dotted key in the message.
        lines.append(f"{key}: {msg}" if key else msg)
    return "; ".join(lines)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[object, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` overrides on purpose
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:
                continue  # unhashable: the base class raises its own error
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {_shown(key)!r} (first given at line {first + 1})", key_node.start_mark
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # more digits than int() converts (4300): a typo, not a size
            raise yaml.constructor.ConstructorError(
                None, None, f"integer of {len(node.value)} characters is too long", node.start_mark
            ) from None


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line: the problem and its line, column (PyYAML's own text spans several lines)."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return f"line {mark.line + 1}, column {mark.column + 1}: {exc.problem}"
    return " ".join(str(exc).split())


def read_config_data(source: str | os.PathLike[str]) -> object:
    """The YAML document of a config file, unvalidated; ConfigError for unreadable or bad YAML."""
    where = str(source)
    try:
        text = Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # ValueError: a NUL in the file name
        raise ConfigError(f"{where}: cannot read config: {exc}") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: invalid YAML: {_yaml_problem(exc)}") from None
    except RecursionError:
        raise ConfigError(f"{where}: invalid YAML: nested too deeply") from None
    return {} if data is None else data


def load_config(source: str | os.PathLike[str] | Mapping[str, Any] | Config | None = None) -> Config:
    """Load a config from a YAML file path, a mapping, or return a Config as is.

    None gives the defaults. Raises ConfigError for unreadable files, bad YAML
    (duplicate keys included), unknown keys, wrong types, bad sizes, capacities
    below one block or beyond this machine's memory or disk (unless allow_overcommit).
    """
    if isinstance(source, Config):
        return source
    where = "config"
    if source is None:
        data: object = {}
    elif isinstance(source, Mapping):
        data = dict(source)
    elif isinstance(source, (str, os.PathLike)):
        where = str(source)
        data = read_config_data(source)
    else:
        raise ConfigError(f"load_config takes a path, a mapping or a Config, not {type(source).__name__}")
    return validate_config(data, where)


def validate_config(data: object, where: str = "config") -> Config:
    """A Config from a parsed document; ConfigError messages start with ``where`` (the file)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: top level must be a mapping of sections, got {type(data).__name__}")
    bad_keys = [k for k in data if not isinstance(k, str)]
    if bad_keys:
        raise ConfigError(f"{where}: section names must be strings, got {_shown(repr(bad_keys[0]))}")
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{where}: {_format_errors(exc)}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply") from None
    except (ValueError, TypeError) as exc:  # pragma: no cover - pydantic wraps these; never a traceback
        raise ConfigError(f"{where}: {exc}") from None


def config_as_dict(cfg: Config) -> dict[str, Any]:
    return cfg.model_dump(mode="json")


def check_host_resources(cfg: Config, bytes_per_block: int) -> None:
    """Refuse tiers this machine cannot hold (a typo like 99999TiB), unless allow_overcommit says so.

    Memory: the CPU tier plus the bookkeeping of every slot, against MemAvailable.
    Disk: every record the tier can write (records are padded to 4 KiB), against the
    free space of the path plus what its namespaces already hold.
    """
    cpu, disk = cfg.tiers.cpu, cfg.tiers.disk
    cpu_slots, disk_slots = cpu.capacity // bytes_per_block, disk.capacity // bytes_per_block if disk.enabled else 0
    slots = cpu_slots + disk_slots
    index = slots * SLOT_OVERHEAD_BYTES
    ghosts = ""
    if cfg.eviction.policy == "window":  # one policy over CPU + disk: ghosts for all their slots
        extra = slots * GHOST_BYTES_PER_SLOT
        index += extra
        ghosts = f", {format_size(extra)} of it the ghosts of eviction.policy 'window'"
    available = mem_available()
    if not cpu.allow_overcommit and available is not None:
        need = cpu.capacity + index
        if need > available:
            raise ConfigError(
                f"tiers.cpu.capacity: {format_size(cpu.capacity)} plus the index of {slots} slots "
                f"({format_size(index)}{ghosts}) needs {need} bytes, more than the "
                f"{available} bytes ({format_size(available)}) of MemAvailable; lower it or set "
                f"tiers.cpu.allow_overcommit: true"
            )
    if disk.enabled and not disk.allow_overcommit:
        record = align_up(DISK_HEADER_SIZE + bytes_per_block)
        need = disk.capacity // bytes_per_block * record
        free = disk_room(Path(disk.path))
        if free is not None and need > free:
            raise ConfigError(
                f"tiers.disk.capacity: {format_size(disk.capacity)} needs {need} bytes on disk "
                f"({format_size(need)} in 4 KiB-aligned records), more than the {free} bytes "
                f"({format_size(free)}) free at {disk.path!r}; lower it or set tiers.disk.allow_overcommit: true"
            )
