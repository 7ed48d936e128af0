"""tiers/segment_geometry.py: the one place both halves learn the segment's geometry from, and the worker's
view of the config (its tiers.cpu and transfer sections only), which must size the segment as the scheduler does."""

from __future__ import annotations

import pytest
import torch
import yaml
from scheduler_helpers import REGIONS, SHARD, shard_layout

import tiered_kv as tkv
from tiered_kv.cross_process import ShardCopier
from tiered_kv.errors import ConfigError
from tiered_kv.tiers.segment_geometry import PAGE, segment_config, segment_info_for


def full_config(tmp_path, world: int) -> dict:
    """A config as a vLLM deployment writes it: no model geometry, a disk and a remote section."""
    return {"model": {"model_id": "geo-test"},
            "tiers": {"cpu": {"capacity": 40 * world * SHARD, "shared_path": str(tmp_path)},
                      "disk": {"enabled": True, "path": str(tmp_path / "disk"), "capacity": 64 * world * SHARD}},
            "transfer": {"max_inflight_bytes": 8 * world * SHARD, "engine": "host"}}  # fmt: skip


@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_worker_sizes_the_segment_exactly_as_the_scheduler(tmp_path, world):
    raw = full_config(tmp_path, world)
    scheduler_cfg = dict(raw, model={"model_id": "geo-test", "bytes_per_block": world * SHARD})
    want = segment_info_for(scheduler_cfg, shard_layout(), world_size=world, engine_id="geo")
    path = tmp_path / "tkv.yaml"
    path.write_text(yaml.safe_dump(raw))
    for source in (raw, str(path)):  # the connector's extra config: a dict or a YAML path
        cfg = segment_config(source, group_bytes_per_block=world * SHARD)
        assert cfg.transfer.engine == "host" and cfg.tiers.cpu.pin_chunk == 1 << 30
        got = segment_info_for(cfg, shard_layout(), world_size=world, engine_id="geo")
        assert got == want and got.page == PAGE and got.num_slots == 40 + 8  # slots + staging rows


def test_the_workers_view_of_the_config_still_validates_what_it_reads(tmp_path):
    with pytest.raises(ConfigError, match="tiers.cpu"):
        segment_config({"tiers": {"cpu": {"capacity": "lots"}}}, group_bytes_per_block=2048)
    with pytest.raises(ConfigError, match="transfer"):
        segment_config({"transfer": {"engine": "gpu"}}, group_bytes_per_block=2048)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_cuda_engine_is_refused_for_the_tensors_device_never_for_the_tp_size(world):
    """transfer.engine cuda was refused at world_size > 1 (a rank's shard was strided inside a row); with the
    rank-major segment only tensors off CUDA are refused, whatever the TP size, and auto picks host here."""
    kv = {n: torch.zeros(64, w, dtype=torch.uint8) for n, w in zip("kv", REGIONS, strict=True)}
    layout = tkv.KVLayout.from_tensors(kv, 64)
    with pytest.raises(ConfigError, match="cuda needs KV tensors on a CUDA device; this rank's are on cpu"):
        ShardCopier(layout, rank=world - 1, world_size=world, engine="cuda")
    auto = ShardCopier(layout, rank=world - 1, world_size=world, engine="auto")
    assert auto.kind == "host"
    auto.close()
