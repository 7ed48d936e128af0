"""End to end with a real (tiny, random-weight) transformers Llama.

Prefill a prompt, page its KV into the engine's tensors, store it through a real
TieredKVCache, clobber the pages, load them into different block ids from the
CPU tier, from disk, or from disk after a restart, and decode from them: the
logits must equal, bit for bit, the same decode fed the original prefill KV.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from paged_kv import LAYOUTS, Geometry, PagedKV, make_paged  # noqa: E402
from tiny_llm import HEAD_DIM, KV_HEADS, LAYERS, VOCAB, Reference, make_reference  # noqa: E402

import tiered_kv as tkv  # noqa: E402

BLOCK_TOKENS, NUM_BLOCKS = 16, 32
PREFIX_BLOCKS = 5
PROMPT_LEN = PREFIX_BLOCKS * BLOCK_TOKENS + 8  # 5 full blocks through the cache, an 8-token tail recomputed
DECODE_STEPS = 3
SRC = [3, 17, 8, 25, 11]  # where the engine computed the prompt's blocks
DST = [20, 6, 29, 0, 14]  # where the later request gets them loaded
FILLER = [1, 2, 4, 5, 7]  # another prompt's blocks, stored to push ours out of the CPU tier
MODEL_ID = "e2e-tiny-llama"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module", params=list(DTYPES))
def ref(request) -> Reference:
    """Built once per dtype: the model, the prompt, its prefill KV and the reference logits."""
    return make_reference(DTYPES[request.param], PROMPT_LEN, PREFIX_BLOCKS * BLOCK_TOKENS, DECODE_STEPS)


def geometry(dtype: torch.dtype) -> Geometry:
    return Geometry(LAYERS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS, NUM_BLOCKS, dtype)


def cache_config(geo: Geometry, tmp_path, *, cpu_blocks: int, disk: bool) -> dict:
    """The geometry stated the way a user would: the model's shape, not a byte count."""
    model = {
        "model_id": MODEL_ID,
        "dtype": str(geo.dtype).removeprefix("torch."),
        "block_tokens": geo.block_tokens,
        "num_layers": geo.layers,
        "num_kv_heads": geo.kv_heads,
        "head_dim": geo.head_dim,
    }
    bpb = geo.bytes_per_block
    tiers: dict = {"cpu": {"capacity": cpu_blocks * bpb}, "disk": {"enabled": False}}
    if disk:
        tiers["disk"] = {"enabled": True, "path": str(tmp_path / "disk"), "capacity": 4 * PREFIX_BLOCKS * bpb}
    return {
        "model": model,
        "gpu": {"num_blocks": geo.num_blocks},
        "tiers": tiers,
        "transfer": {"engine": "auto"},
    }


def engine_kv(kind: str, geo: Geometry, seed: int, device: str = "cpu") -> PagedKV:
    """Fresh engine tensors full of garbage, so a block that is not loaded cannot pass for one."""
    paged = make_paged(kind, geo, device)
    paged.scribble(torch.Generator().manual_seed(seed))
    return paged


def open_cache(paged: PagedKV, cfg: dict) -> tkv.TieredKVCache:
    layout = paged.layout()
    assert layout.bytes_per_block == paged.geo.bytes_per_block  # padding never counts
    return tkv.TieredKVCache(cfg, layout)


async def store_then_load(ref: Reference, kind: str, source: str, tmp_path, device: str = "cpu"):
    """The whole schedule; returns (engine tensors holding the loaded blocks, expected page bytes, padding)."""
    geo = geometry(ref.dtype)
    paged = engine_kv(kind, geo, seed=1, device=device)
    paged.write_prefix(ref.prefix_kv(), SRC)
    expected = paged.page_bytes(SRC)
    padding = paged.padding()
    cfg = cache_config(
        geo,
        tmp_path,
        cpu_blocks=PREFIX_BLOCKS if source != "cpu" else 2 * PREFIX_BLOCKS,
        disk=source != "cpu",
    )
    cache = await open_cache(paged, cfg).start()
    try:
        keys = cache.keyer.keys_for_tokens(ref.prompt.tolist())
        assert len(keys) == PREFIX_BLOCKS  # the 8-token tail is no full block
        assert (await cache.store(keys, SRC)).stored == PREFIX_BLOCKS
        paged.scribble(torch.Generator().manual_seed(2), SRC)  # the engine reuses those blocks
        if source != "cpu":
            # Another prompt fills the CPU tier: ours are evicted, spilled to disk first.
            other = cache.keyer.keys_for_tokens(((ref.prompt + 1) % VOCAB).tolist())
            assert (await cache.store(other, FILLER)).stored == PREFIX_BLOCKS
        if source == "restart":
            await cache.aclose()
            paged = engine_kv(kind, geo, seed=3, device=device)  # a new process: new tensors
            padding = paged.padding()
            cache = await open_cache(paged, cfg).start()
            assert cache.recovered_blocks >= PREFIX_BLOCKS
            assert cache.keyer.keys_for_tokens(ref.prompt.tolist()) == keys
        hit = cache.lookup(keys)
        want_cpu = PREFIX_BLOCKS if source == "cpu" else 0
        assert (hit.total, hit.cpu, hit.disk) == (PREFIX_BLOCKS, want_cpu, PREFIX_BLOCKS - want_cpu)
        assert await cache.load(keys, DST) == PREFIX_BLOCKS
    finally:
        await cache.aclose()
    return paged, expected, padding


@pytest.mark.parametrize("source", ["cpu", "disk", "restart"])
@pytest.mark.parametrize("kind", LAYOUTS)
async def test_decode_from_loaded_kv_is_bit_identical(ref: Reference, kind: str, source: str, tmp_path):
    paged, expected, padding = await store_then_load(ref, kind, source, tmp_path)
    assert_loaded_exactly(ref, paged, expected, padding)


def assert_loaded_exactly(ref: Reference, paged: PagedKV, expected: list, padding: list) -> None:
    # The pages are byte-exact copies, and nothing was written past any logical size.
    for got, want in zip(paged.page_bytes(DST), expected, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(paged.padding(), padding, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(ref.decode(paged.read_prefix(DST), DECODE_STEPS), ref.logits)


def flip_one_byte(paged: PagedKV, block_id: int) -> None:
    """Flip the sign byte of layer 0's largest K element in one page (little-endian: its last byte)."""
    page = paged.k_pages[0][block_id]
    j = int(page.float().abs().reshape(-1).argmax())
    size = page.element_size()
    page.view(torch.uint8).view(-1)[j * size + size - 1] ^= 0x80


@pytest.mark.parametrize("kind", ["separate", "padded"])
async def test_one_flipped_byte_changes_the_logits(ref: Reference, kind: str, tmp_path):
    """The negative control: the bit-for-bit comparison does see one wrong byte of KV."""
    paged, _, _ = await store_then_load(ref, kind, "cpu", tmp_path)
    assert torch.equal(ref.decode(paged.read_prefix(DST), DECODE_STEPS), ref.logits)
    flip_one_byte(paged, DST[2])
    assert not torch.equal(ref.decode(paged.read_prefix(DST), DECODE_STEPS), ref.logits)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("kind", "dtype", "source"), [("padded", "bfloat16", "disk"), ("fused", "float32", "restart")]
)
async def test_decode_from_loaded_kv_on_cuda(kind: str, dtype: str, source: str, tmp_path):
    """The same schedule with the model and the engine's KV on the GPU (the CUDA stream engine)."""
    cuda_ref = make_reference(
        DTYPES[dtype], PROMPT_LEN, PREFIX_BLOCKS * BLOCK_TOKENS, DECODE_STEPS, device="cuda"
    )
    assert_loaded_exactly(cuda_ref, *await store_then_load(cuda_ref, kind, source, tmp_path, device="cuda"))
