"""A tiny random-weight Llama saved locally, so the vLLM tests download nothing."""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 1000


def make_tiny_llama(path: Path, *, hidden: int = 256, layers: int = 4, seed: int = 0,
                    init_std: float | None = None) -> Path:
    """Write config + safetensors weights (seeded) to ``path``; return it.

    ``init_std``: draw every matrix from N(0, init_std). The default init (0.02) gives near-constant
    greedy tokens, which no wrong KV changes; 0.2 makes the output depend on every position's KV.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 32, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
        torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    if init_std is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, init_std)
    model = model.to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return path
