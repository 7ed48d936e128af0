"""A tiny DeepSeek-V4's real KV cache (vLLM 0.32's own config and views, built without a forward pass:
dsv4_kv_config.py) through the connector's real halves (step_harness.py), in a process of its own (building the
model's layers sets up torch.distributed). Prints one JSON line.

Usage: python dsv4_steps.py WORKDIR PHASE [MODEL_DIR] (main's docstring). The "forward" is the test's: random bytes in every row a prompt's block ids
own, before the step whose save stores them; then other bytes over them, a second prompt with the same first 256
tokens, and its loaded rows compared with the first prompt's, group by group, byte for byte.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace as NS

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import dsv4_workarounds  # noqa: E402

dsv4_workarounds.install()  # before vLLM is imported (prefix caching kept on without AMX)

import torch  # noqa: E402
from conftest import corrupt_payloads, tokens  # noqa: E402
from dsv4_kv_config import build  # noqa: E402
from step_harness import Harness, request  # noqa: E402
from tiny_deepseek_v4 import make_tiny_deepseek_v4  # noqa: E402

from tiered_kv.integrations.vllm.block_bytes import scheduler_bytes_per_block  # noqa: E402

NUM_BLOCKS = 256
A = tokens(1, 300)
B = A[:256] + tokens(2, 44)


def block_ids(kcc, prompt_len: int, start: int) -> tuple[list[int], ...]:
    """Fresh ids for every group's blocks of a prompt (one pool: a block id is owned by one group)."""
    out, nxt = [], start
    for g in kcc.kv_cache_groups:
        n = -(-prompt_len // g.kv_cache_spec.block_size)
        out.append(list(range(nxt, nxt + n)))
        nxt += n
    return tuple(out)


def ask_until_answered(h: Harness, req, steps: int = 60) -> tuple[int, bool]:
    """vLLM's loop for a waiting request: asked each step until a number comes (a disk hit is promoted first)."""
    for _ in range(steps):
        n, is_async = h.sched.matched_tokens(req, 0)
        if n is not None:
            return n, is_async
        h.step()
        time.sleep(0.005)
    raise AssertionError(f"still answered None after {steps} steps")


def main() -> None:
    """Phases: ``cpu`` (store, then a hit from the CPU tier), ``store`` (store through to disk and stop), ``restart``
    (a fresh process over that disk: the hit promoted from disk), ``corrupt`` (every record's bytes flipped first)."""
    work, phase = Path(sys.argv[1]), sys.argv[2]
    model = Path(sys.argv[3]) if len(sys.argv) > 3 else work / "model"  # one path: the namespace names it
    if not (model / "config.json").exists():
        make_tiny_deepseek_v4(model)
    vllm_config, kcc, sched_kcc, views = build(str(model), num_blocks=NUM_BLOCKS, max_model_len=512)
    row = scheduler_bytes_per_block(kcc)
    storage = next(iter(views.values())).untyped_storage()
    rows = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (NUM_BLOCKS, row), (row, 1))
    a_ids = block_ids(kcc, len(A), 1)  # block 0 is vLLM's null block
    gen = torch.Generator().manual_seed(7)
    written = {g: torch.randint(0, 256, (len(ids), row), dtype=torch.uint8, generator=gen) for g, ids in enumerate(a_ids)}
    disk = {} if phase == "cpu" else {"disk": "32MiB", "spill": "write_through"}
    if phase == "corrupt":
        corrupt_payloads(work / "disk")
    h = Harness(work, cpu="16MiB", engine_kv=(vllm_config, kcc, sched_kcc, views), **disk)
    out: dict = {"row": row, "layout": kcc.kv_cache_layout, "groups": h.sched.report()["groups"],
                 "bytes_per_block": h.sched.report()["stats"]["bytes_per_block"]}  # fmt: skip
    try:
        if phase in ("cpu", "store"):
            for g, ids in enumerate(a_ids):
                rows[ids] = written[g]  # the "forward"
            a = request("a", A)
            out["a_hit"] = h.admit(a, a_ids)[0]
            h.step(new=[(a, a_ids, 0, len(A))])
            h.idle()
            h.finish(a)
            h.idle()
            out["stored"] = {k: v for k, v in h.counters().items() if k.startswith("stored_")}
        if phase == "store":
            return
        rows[:] = 0  # other requests' KV everywhere
        b_ids = block_ids(kcc, len(B), 1 + sum(map(len, a_ids)))
        b = request("b", B)
        h.sched.on_new_request(b)
        n, is_async = ask_until_answered(h, b)
        out["b_hit"], out["b_async"] = n, is_async
        if n:
            h.sched.after_alloc(b, NS(get_block_ids=lambda: b_ids), n)
            for _ in range(30):
                h.step()
                if "b" in h.finished_recving:
                    break
        out["b_loaded"] = "b" in h.finished_recving
        loaded: dict[str, list[int]] = {}
        for g, (old, new) in enumerate(zip(a_ids, b_ids, strict=True)):
            same = [i for i in range(min(len(old), len(new))) if torch.equal(rows[new[i]], written[g][i])]
            loaded[str(g)] = same  # the block indices whose whole row came back
        out["loaded_rows"] = loaded
        out["counters"] = h.counters()
    finally:
        h.close()
        print(json.dumps(out))


if __name__ == "__main__":
    main()
