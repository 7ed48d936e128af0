"""YAML -> typed config. Every fault is a ConfigError that names the dotted key.

The model section exists so that ``bytes_per_block`` can be planned before any
tensor exists; the CPU and disk slot counts are always
``capacity // bytes_per_block`` of the same layout (see layout.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .errors import ConfigError
from .sizes import format_size, parse_size

ByteSize = Annotated[int, BeforeValidator(parse_size)]

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


class _Section(BaseModel):
    # strict: a YAML string "8" is not silently an int; forbid: typos are errors.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# The model_id a config gets when it names none. Blocks are only as trustworthy as the
# namespace they are filed under, so a disk tier (which outlives the process) refuses it.
PLACEHOLDER_MODEL_ID = "demo-model"


class ModelConfig(_Section):
    """Geometry of the KV cache: either ``bytes_per_block`` or the full shape."""

    # Must change whenever the weights change: KV computed by other weights is wrong KV.
    model_id: str = Field(PLACEHOLDER_MODEL_ID, min_length=1)
    revision: str = ""  # e.g. a checkpoint hash; part of every key and of the disk namespace
    allow_placeholder_id: bool = False  # let a disk tier run under the placeholder model_id
    dtype: Literal[tuple(DTYPE_BYTES)] = "float16"  # type: ignore[valid-type]
    block_tokens: int = Field(16, gt=0)
    bytes_per_block: ByteSize | None = None
    num_layers: int | None = Field(None, gt=0)
    num_kv_heads: int | None = Field(None, gt=0)
    head_dim: int | None = Field(None, gt=0)
    # 2 for separate K and V tensors per layer, 1 for a fused latent (MLA).
    kv_tensors_per_layer: int = Field(2, gt=0)

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
        return self

    def region_block_bytes(self) -> list[int]:
        """Per-region bytes of one block: one region per K/V tensor per layer."""
        if self.bytes_per_block is not None:
            return [self.bytes_per_block]
        per_tensor = self.block_tokens * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]  # type: ignore[operator]
        return [per_tensor] * (self.num_layers * self.kv_tensors_per_layer)  # type: ignore[operator]


class GpuConfig(_Section):
    num_blocks: int = Field(1024, gt=0)
    device: str = "auto"


def _on_off(value: object) -> object:
    # YAML 1.1 reads a bare `on` / `off` as a boolean.
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class CpuTierConfig(_Section):
    capacity: ByteSize = parse_size("1GiB")
    pin_memory: Annotated[Literal["auto", "on", "off"], BeforeValidator(_on_off)] = "auto"
    pin_chunk: ByteSize = parse_size("1GiB")


class DiskTierConfig(_Section):
    enabled: bool = True
    path: str = ".tiered_kv_cache"
    capacity: ByteSize = parse_size("8GiB")
    spill_policy: Literal["write_back", "write_through"] = "write_back"
    o_direct: bool = False
    fsync: bool = False
    max_concurrent_spills: int = Field(4, gt=0)
    io_threads: int = Field(4, gt=0)
    allow_symlink: bool = False

    @field_validator("path")
    @classmethod
    def _usable_path(cls, path: str, info: ValidationInfo) -> str:
        if info.data.get("enabled", True):
            problem = _dir_problem(Path(os.path.expanduser(path)))
            if problem:
                raise ValueError(f"{path!r} {problem}")
        return path


class TiersConfig(_Section):
    cpu: CpuTierConfig = CpuTierConfig()
    disk: DiskTierConfig = DiskTierConfig(enabled=False)


class EvictionConfig(_Section):
    policy: Literal["lru", "arc"] = "lru"


class TransferConfig(_Section):
    engine: Literal["auto", "host", "cuda"] = "auto"
    max_inflight_bytes: ByteSize = parse_size("256MiB")


class KeysConfig(_Section):
    hash: Literal["sha256", "xxh3_128"] = "sha256"
    tenant_salt: str = ""


class ReplayConfig(_Section):
    num_requests: int = Field(1200, gt=0)
    max_requests: int | None = Field(None, gt=0)
    concurrency: int = Field(8, gt=0)
    speed: float = Field(0.0, ge=0)  # 0 = as fast as possible, else trace time / speed
    seed: int = 0
    block_bytes: ByteSize | None = None  # synthetic block size; overrides model geometry for the replay


class Config(_Section):
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
    """Each tier must hold at least one block of the layout actually used."""
    tiers = [("tiers.cpu.capacity", cfg.tiers.cpu.capacity)]
    if cfg.tiers.disk.enabled:
        tiers.append(("tiers.disk.capacity", cfg.tiers.disk.capacity))
    for key, capacity in tiers:
        if capacity < bytes_per_block:
            raise ConfigError(
                f"{key}: {capacity} bytes ({format_size(capacity)}) is smaller than one block "
                f"(bytes_per_block = {bytes_per_block})"
            )


def _dir_problem(path: Path) -> str | None:
    """Why ``path`` cannot hold the disk tier, or None. A missing dir is fine if creatable."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            return "has no existing parent directory"
        probe = probe.parent
    if not probe.is_dir():
        return f"is not a directory ({probe} is a file)" if probe == path else f"cannot be created: {probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"is not writable ({probe})"
    return None


def _format_errors(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        # Cross-section checks already name their dotted key in the message.
        lines.append(f"{key}: {msg}" if key else msg)
    return "; ".join(lines)


def load_config(source: str | os.PathLike[str] | Mapping[str, Any] | Config | None = None) -> Config:
    """Load a config from a YAML file path, a mapping, or return a Config as is.

    None gives the defaults. Raises ConfigError for unreadable files, bad YAML,
    unknown keys, wrong types, bad sizes or capacities below one block.
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
        try:
            text = Path(source).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{where}: cannot read config: {exc}") from exc
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{where}: invalid YAML: {exc}") from exc
        if data is None:
            data = {}
    else:
        raise ConfigError(f"load_config takes a path, a mapping or a Config, not {type(source).__name__}")
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: top level must be a mapping of sections, got {type(data).__name__}")
    bad_keys = [k for k in data if not isinstance(k, str)]
    if bad_keys:
        raise ConfigError(f"{where}: section names must be strings, got {bad_keys[0]!r}")
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{where}: {_format_errors(exc)}") from None
    except (ValueError, TypeError, RecursionError) as exc:  # pragma: no cover - pydantic wraps these
        raise ConfigError(f"{where}: {exc}") from None


def config_as_dict(cfg: Config) -> dict[str, Any]:
    return cfg.model_dump(mode="json")
