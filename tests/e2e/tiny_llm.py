"""A tiny random-weight Llama built from a config: no downloads, no tokenizer, token ids in.

The reference decode and the decode from loaded KV go through ``decode_logits``
alike (same shapes, same cache class, fresh contiguous tensors), so the only
thing that differs between them is where the prefix KV came from.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

LAYERS, HEADS, KV_HEADS, HIDDEN, VOCAB = 2, 4, 2, 64, 512
HEAD_DIM = HIDDEN // HEADS

# transformers 5.x renamed the forward's `past_key_values` argument to `cache`
# (the old name is deprecated); pass whichever this version takes.
_CACHE_ARG = (
    "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
)

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), each [batch, kv_heads, seq, head_dim]


def build_model(dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        # 10x the default init: attention is peaked, so a wrong KV element moves the logits
        # well past bf16 rounding (at 0.02 attention is near uniform and mostly averages it away).
        initializer_range=0.2,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def _forward(model: LlamaForCausalLM, ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    return model(input_ids=ids.view(1, -1), use_cache=True, **{_CACHE_ARG: cache}).logits


def layer_kv(cache: DynamicCache) -> KV:
    """Per-layer (K, V) out of a DynamicCache, across the cache API generations."""
    if hasattr(cache, "layers"):  # transformers >= 4.54: one object per layer
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


@torch.no_grad()
def prefill(model: LlamaForCausalLM, prompt: torch.Tensor) -> KV:
    cache = DynamicCache()
    _forward(model, prompt, cache)
    return [(k.clone(), v.clone()) for k, v in layer_kv(cache)]


@torch.no_grad()
def decode_logits(model: LlamaForCausalLM, prefix_kv: KV, tail: torch.Tensor, steps: int) -> torch.Tensor:
    """Recompute the prompt's tail over the prefix KV, then decode ``steps`` greedy tokens.

    Returns the logits of every position run, [1, len(tail) + steps, vocab].
    """
    cache = DynamicCache()
    for i, (k, v) in enumerate(prefix_kv):
        cache.update(k.contiguous().clone(), v.contiguous().clone(), i)
    logits = [_forward(model, tail, cache)]
    for _ in range(steps):
        token = logits[-1][0, -1].argmax().view(1)
        logits.append(_forward(model, token, cache))
    return torch.cat(logits, dim=1)


@dataclass
class Reference:
    """One dtype's model, prompt, original prefill KV and the logits decoded from it."""

    model: LlamaForCausalLM
    dtype: torch.dtype
    prompt: torch.Tensor  # token ids, [prompt_len]
    prefix_tokens: int  # the full blocks' worth of tokens whose KV goes through the cache
    kv: KV  # the original prefill KV, all prompt positions
    logits: torch.Tensor

    def prefix_kv(self) -> KV:
        n = self.prefix_tokens
        return [(k[:, :, :n], v[:, :, :n]) for k, v in self.kv]

    def decode(self, prefix_kv: KV, steps: int) -> torch.Tensor:
        return decode_logits(self.model, prefix_kv, self.prompt[self.prefix_tokens :], steps)


def make_reference(
    dtype: torch.dtype, prompt_len: int, prefix_tokens: int, steps: int, device: str = "cpu"
) -> Reference:
    model = build_model(dtype, device)
    gen = torch.Generator().manual_seed(1234)
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=gen).to(device)
    kv = prefill(model, prompt)
    prefix = [(k[:, :, :prefix_tokens], v[:, :, :prefix_tokens]) for k, v in kv]
    logits = decode_logits(model, prefix, prompt[prefix_tokens:], steps)
    return Reference(model, dtype, prompt, prefix_tokens, kv, logits)
