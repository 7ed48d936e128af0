"""One emulated serving instance: its KV tensors (checked to fit), its cache and its engine emulator."""

from __future__ import annotations

import torch

from ..cache import TieredKVCache
from ..config import Config
from ..errors import ConfigError
from ..host_checks import mem_available
from ..layout import KVLayout
from ..sizes import format_size
from .engine import EngineEmulator


def _device(cfg: Config) -> torch.device:
    name = cfg.gpu.device
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"gpu.device: {name!r} needs CUDA, and torch.cuda.is_available() is False")
    return dev


def make_kv(cfg: Config) -> dict[str, torch.Tensor]:
    """The emulated engine's KV tensors: one ``[num_blocks, region_bytes]`` uint8 tensor per region."""
    dev = _device(cfg)
    n = cfg.gpu.num_blocks
    _check_kv_fits(cfg, dev)
    return {
        f"kv{i}": torch.zeros(n, b, dtype=torch.uint8, device=dev)
        for i, b in enumerate(cfg.model.region_block_bytes())
    }


def _check_kv_fits(cfg: Config, dev: torch.device) -> None:
    """The emulated GPU tensors (on a CPU device, beside the CPU tier) must fit in free memory."""
    gpu_bytes = cfg.gpu.num_blocks * cfg.bytes_per_block
    if dev.type == "cuda":
        free, need, where = torch.cuda.mem_get_info(dev)[0], gpu_bytes, f"free on {dev}"
    else:
        cpu_tier = 0 if cfg.tiers.cpu.allow_overcommit else cfg.tiers.cpu.capacity
        free, need = mem_available(), gpu_bytes + cpu_tier
        where = f"of MemAvailable (with the CPU tier's {format_size(cpu_tier)} beside it)"
    if free is not None and need > free:
        raise ConfigError(
            f"gpu.num_blocks: the replay's emulated KV cache of {cfg.gpu.num_blocks} blocks x {cfg.bytes_per_block} "
            f"bytes ({format_size(gpu_bytes)}) needs {need} bytes, more than the {free} bytes ({format_size(free)}) "
            f"{where}"
        )


def new_cache(cfg: Config) -> TieredKVCache:
    """A cache (not started) over fresh emulated KV tensors of this config."""
    return TieredKVCache(cfg, KVLayout.from_tensors(make_kv(cfg), cfg.gpu.num_blocks))


def new_emulator(cfg: Config, cache: TieredKVCache, block_tokens: int) -> EngineEmulator:
    """The engine emulator over a started ``cache``'s KV tensors, with the config's replay options."""
    return EngineEmulator(cache, cache.layout.regions, hints=cfg.replay.hints,
                          drop_partial=cfg.replay.drop_partial, block_tokens=block_tokens)  # fmt: skip
