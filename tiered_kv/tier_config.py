"""The tiers' sections of the config (CPU, disk, remote) and the base every section shares.

Split from config.py, which holds the rest of the config and its loading; the
types here are re-read from there (``from .tier_config import ...``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .host_checks import dir_problem, expand_path
from .redis_url import env_name_problem, node_problem, redact, url_db, url_problem
from .sizes import parse_size

ByteSize = Annotated[int, BeforeValidator(parse_size)]


class Section(BaseModel):
    # strict: a YAML string "8" is not silently an int; forbid: typos are errors.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)



def _on_off(value: object) -> object:
    # YAML 1.1 reads a bare `on` / `off` as a boolean.
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class CpuTierConfig(Section):
    capacity: ByteSize = parse_size("1GiB")
    pin_memory: Annotated[Literal["auto", "on", "off"], BeforeValidator(_on_off)] = "auto"
    pin_chunk: ByteSize = parse_size("1GiB")
    allow_overcommit: bool = False  # skip the check that the tiers' memory fits in MemAvailable
    # The directory (a tmpfs or hugetlbfs) of the shared-memory segment when the CPU tier is shared
    # between a scheduler and its workers (the vLLM connector); the single-process cache ignores it.
    shared_path: str = "/dev/shm"

    @field_validator("shared_path")
    @classmethod
    def _expanded(cls, path: str) -> str:
        return expand_path(path)


class DiskTierConfig(Section):
    enabled: bool = True
    path: str = ".tiered_kv_cache"
    capacity: ByteSize = parse_size("8GiB")
    spill_policy: Literal["write_back", "write_through"] = "write_back"
    o_direct: bool = False
    fsync: bool = False
    max_concurrent_spills: int = Field(4, gt=0, le=4096)
    io_threads: int = Field(4, gt=0, le=1024)
    allow_symlink: bool = False
    allow_overcommit: bool = False  # skip the check that capacity fits in the path's free space

    @field_validator("path")
    @classmethod
    def _usable_path(cls, path: str, info: ValidationInfo) -> str:
        path = expand_path(path)
        if info.data.get("enabled", True):
            problem = dir_problem(Path(path))
            if problem:
                raise ValueError(f"{path!r} {problem}")
        return path


class RemoteTierConfig(Section):
    """The shared remote tier on Redis or Redis Cluster (off by default).

    Cross-instance sharing needs ``write: write_through``: with write_back a block reaches Redis only
    when this instance evicts it from CPU, so other instances see it late or never.
    """

    enabled: bool = False
    url: str = "redis://127.0.0.1:6379/0"  # redis://, rediss:// (TLS) or unix:///path.sock; never a password
    cluster: bool = False  # Redis Cluster: `nodes` are the seeds (the url's host:port when empty)
    nodes: list[str] = Field(default_factory=list, max_length=1024)
    capacity: ByteSize = parse_size("8GiB")  # for `plan` only: Redis's own maxmemory policy evicts
    ttl: int = Field(0, ge=0, le=10 * 365 * 86400)  # seconds a block lives in Redis; 0 = no expiry
    key_prefix: str = Field("tkv:", max_length=256)
    max_concurrency: int = Field(16, gt=0, le=1024)  # connections (and batches in flight) per server
    timeout: float = Field(1.0, gt=0, le=300)  # seconds per connect / reply before the tier degrades
    password_env: str | None = None  # the NAME of the environment variable holding the password
    write: Literal["write_through", "write_back"] = "write_through"

    @model_validator(mode="before")
    @classmethod
    def _no_password_in_file(cls, data: object) -> object:
        if isinstance(data, Mapping) and "password" in data:
            raise ValueError("password: a password never goes in the config file; put it in an environment "
                             "variable and name that variable in tiers.remote.password_env")
        return data

    @model_validator(mode="after")
    def _valid_endpoints(self) -> RemoteTierConfig:
        problem = url_problem(self.url)
        if problem:
            raise ValueError(f"url: {redact(self.url)[:200]!r} {problem}")
        if self.password_env is not None and env_name_problem(self.password_env):
            raise ValueError(f"password_env: {env_name_problem(self.password_env)}")
        if any(c.isspace() or not c.isprintable() for c in self.key_prefix):
            raise ValueError(f"key_prefix: {self.key_prefix[:80]!r} holds whitespace or control characters")
        if not self.cluster:
            if self.nodes:
                raise ValueError("nodes: seed nodes are for a cluster; set cluster: true or remove them")
            return self
        if self.url.startswith("unix:"):
            raise ValueError(f"cluster: Redis Cluster needs TCP nodes, not {redact(self.url)!r}")
        if url_db(self.url) != 0:
            raise ValueError(f"url: Redis Cluster has only database 0, not {url_db(self.url)}")
        for node in self.nodes:
            if node_problem(node):
                raise ValueError(f"nodes: {node_problem(node)}")
        return self


class TiersConfig(Section):
    cpu: CpuTierConfig = CpuTierConfig()
    disk: DiskTierConfig = DiskTierConfig(enabled=False)
    remote: RemoteTierConfig = RemoteTierConfig()
