"""The scheduler side of a serving-engine integration that no engine owns; nothing here imports an engine.

What a second engine's connector (SGLang, say) needs beside its own protocol code:

- ``cache_calls``: every call a scheduler makes into the cross-process cache from the engine's own
  thread (the cache's loop thread, the state lock, synchronous stores and loads, joins);
- ``groups``: the KV cache groups a model stores (full, sliding window, state) and what a hit needs of each;
- ``hits``: the longest prefix every group can serve; ``tails`` / ``tail_keys``: hits that end inside a block;
- ``request_keys``: block keys stable across processes and restarts, salted by what else shapes the KV;
- ``requests``: the per-request state a scheduler keeps; ``hints``: per-request cache hints.

Engine types are read duck-typed (attribute and class names only). ``integrations/vllm/`` speaks vLLM's
protocol over these modules.
"""
