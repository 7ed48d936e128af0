"""Configs for replay tests: small enough for CI, every tier able to serve hits."""

from __future__ import annotations

from pathlib import Path

import yaml

BLOCK = 4096


def small_config(tmp_path: Path, *, requests: int = 150, gpu: int = 96, cpu: int = 128, disk: int = 512,
                 disk_enabled: bool = True, concurrency: int = 4) -> dict:  # fmt: skip
    """A replay small enough for CI in which the GPU, CPU and disk tiers each serve hits."""
    return {
        "model": {"model_id": "replay-test", "bytes_per_block": BLOCK},
        "gpu": {"num_blocks": gpu, "device": "cpu"},
        "tiers": {
            "cpu": {"capacity": cpu * BLOCK, "pin_memory": "off"},
            "disk": {"enabled": disk_enabled, "path": str(tmp_path / "disk"), "capacity": disk * BLOCK},
        },
        "transfer": {"engine": "host"},
        "replay": {"num_requests": requests, "concurrency": concurrency, "seed": 1},
    }


def write_config(tmp_path: Path, cfg: dict) -> str:
    path = tmp_path / "replay.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)
