"""vLLM's KVCacheConfig (and the per-layer KV views it allocates) as plain JSON, for tests and findings.

:func:`kv_cache_config_json` is what engine_proc.py's ``"dump_kv_cache_config"`` writes (taken in the worker
through ``LLM.collective_rpc``) and what dsv4_kv_config.py writes without an engine.
"""

from __future__ import annotations

import dataclasses
import enum


def _plain(value):
    """A spec field as JSON: dataclasses, enums, dtypes and MultipleOf become strings or dicts."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"class": type(value).__name__, **{f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    return str(value)


def spec_json(spec) -> dict:
    out = {"class": type(spec).__name__}
    for f in dataclasses.fields(spec):
        out[f.name] = _plain(getattr(spec, f.name))
    for prop in ("block_size", "page_size_bytes", "real_page_size_bytes", "prefix_cacheable", "has_layer_views",
                 "uses_slot_mapping", "num_heads", "num_states"):  # fmt: skip
        try:
            out[prop] = _plain(getattr(spec, prop))
        except Exception as e:  # noqa: BLE001 - a property a spec class does not have
            out[prop] = f"<{type(e).__name__}>"
    return out


def view_json(t) -> dict:
    return {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype).removeprefix("torch."),
            "storage_offset": t.storage_offset(), "data_ptr_offset": None}  # fmt: skip


def kv_cache_config_json(cfg, kv_caches: dict | None = None, source: str = "") -> dict:
    """``cfg``: a vllm.v1.kv_cache_interface.KVCacheConfig; ``kv_caches``: layer name -> the tensor vLLM
    allocated for it (allocate_kv_cache's manager views, the ones a connector is given)."""
    out: dict = {
        "source": source,
        "num_blocks": cfg.num_blocks,
        "kv_cache_layout": cfg.kv_cache_layout,
        "hash_block_size": cfg.hash_block_size,
        "cache_hit_alignment_tokens": cfg.cache_hit_alignment_tokens,
        "kv_tp_replicas": getattr(cfg, "kv_tp_replicas", None),
        "prefix_cache_retention_interval": getattr(cfg, "prefix_cache_retention_interval", None),
        "kv_cache_groups": [],
        "kv_cache_tensors": [],
    }
    for i, g in enumerate(cfg.kv_cache_groups):
        spec = g.kv_cache_spec
        out["kv_cache_groups"].append({
            "index": i,
            "spec_class": type(spec).__name__,
            "block_size": spec.block_size,
            "page_size_bytes": spec.page_size_bytes,
            "sliding_window": getattr(spec, "sliding_window", None),
            "is_eagle_group": g.is_eagle_group,
            "host_resident": g.host_resident,
            "enable_kv_transfer": g.enable_kv_transfer,
            "role": _plain(g.role),
            "spec": spec_json(spec),
            "layer_names": list(g.layer_names),
        })  # fmt: skip
    for i, t in enumerate(cfg.kv_cache_tensors):
        entry = {"index": i, "size": t.size, "layers": list(t.layers), "layer_stride": t.layer_stride,
                 "block_stride": t.block_stride, "offset": t.offset, "host_resident": t.host_resident}  # fmt: skip
        try:
            entry["num_blocks_of"] = cfg.num_blocks_of(t)
        except Exception:  # noqa: BLE001
            pass
        out["kv_cache_tensors"].append(entry)
    if kv_caches:
        storages = {}
        views = {}
        for name, t in kv_caches.items():
            st = t.untyped_storage()
            key = st.data_ptr()
            storages.setdefault(key, {"nbytes": st.nbytes(), "layers": []})["layers"].append(name)
            v = view_json(t)
            v["data_ptr_offset"] = t.data_ptr() - key
            v["storage"] = list(storages).index(key)
            views[name] = v
        out["storages"] = list(storages.values())
        out["layer_views"] = views
    return out
