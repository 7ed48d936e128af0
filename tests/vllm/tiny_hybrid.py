"""Tiny random-weight hybrid models saved locally (issue 26): several KV cache groups, no downloads.

- ``sw-llama``: a Llama with three sliding-window layers (window 64) and one full-attention layer;
- ``gemma3``: Gemma 3's text model, the same mix (untied embeddings: tied ones at this init only echo the
  last token);
- ``qwen3-next``: three linear-attention (Gated DeltaNet, Mamba-style state) layers and one full one;
- ``deepseek-v2``: MLA (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64: the 576 the CPU MLA kernel needs),
  one KV cache group whose KV is identical on every TP rank.

Weights are drawn from N(0, 0.2): the default init gives near-constant greedy tokens, which no wrong KV
changes.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 1000
WINDOW = 64
INIT_STD = 0.2
# Per family, per module: the linear-attention layers' output drawn wider and the full-attention
# layer's narrower, so the greedy tokens depend on the restored recurrent state, not only on full KV.
_STD = {"qwen3-next": {"out_proj": 0.6, "o_proj": 0.05}}


def _config(family: str):
    common = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    if family == "sw-llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(**common, sliding_window=WINDOW, layer_types=["sliding_attention"] * 3 + ["full_attention"])
        return cfg, LlamaForCausalLM
    if family == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        cfg = Gemma3TextConfig(**common, sliding_window=WINDOW, query_pre_attn_scalar=32, tie_word_embeddings=False,
                               layer_types=["sliding_attention"] * 3 + ["full_attention"])  # fmt: skip
        return cfg, Gemma3ForCausalLM
    if family == "qwen3-next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        cfg = Qwen3NextConfig(**common, layer_types=["linear_attention"] * 3 + ["full_attention"],
                              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                              linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
                              decoder_sparse_step=1)  # fmt: skip
        return cfg, Qwen3NextForCausalLM
    if family == "deepseek-v2":  # MLA: one latent KV per token, the same on every TP rank
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        cfg = DeepseekV2Config(**{**common, "num_hidden_layers": 2, "num_key_value_heads": 4, "num_attention_heads": 4},
                               kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                               q_lora_rank=None, first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=128, n_shared_experts=1)  # fmt: skip
        return cfg, DeepseekV2ForCausalLM
    raise ValueError(f"unknown tiny hybrid family {family!r}")


def make_tiny_hybrid(path: Path, family: str, *, dtype: str = "float32", seed: int = 0) -> Path:
    """Write config + safetensors weights (seeded) to ``path``; return it."""
    import torch

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg, cls = _config(family)
    cfg.dtype = dtype
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, _STD.get(family, {}).get(name.rsplit(".", 2)[-2], INIT_STD))
    model = model.to(getattr(torch, dtype))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return path
