"""One TP rank's worker for the cross-process tests: real KV tensors, a ShardCopier, commands over a pipe.

Run with multiprocessing (spawn): ``run(conn, cfg, rank, world, engine_id)``. It opens the engine's
segment from its own numbers (as a vLLM worker does in register_kv_caches, before the scheduler exists),
then obeys: ("jobs", [ShardJob...]) submit; ("mute", bool) hold completions back (a rank that never
reports); ("fill", gen) write pattern(rank, block, gen) into every GPU block; ("check", {gpu: (block, gen)})
answer the blocks whose bytes differ; ("exit",). Completions are pushed as ("done", ok, failed).
"""

from __future__ import annotations

import numpy as np

REGIONS = (768, 256)
NUM_BLOCKS = 64


def pattern(rank: int, block: int, gen: int) -> np.ndarray:
    return np.random.default_rng([rank, block, gen]).integers(0, 256, sum(REGIONS), dtype=np.uint8)


def run(conn, cfg: dict, rank: int, world: int, engine_id: str) -> None:
    import torch

    import tiered_kv as tkv
    from tiered_kv.cross_process import ShardCopier, segment_info_for

    kv = {"k": torch.zeros(NUM_BLOCKS, REGIONS[0], dtype=torch.uint8),
          "v": torch.zeros(NUM_BLOCKS, REGIONS[1], dtype=torch.uint8)}  # fmt: skip
    layout = tkv.KVLayout.from_tensors(kv, NUM_BLOCKS)
    copier = ShardCopier(layout, rank=rank, world_size=world)
    try:
        copier.open(segment_info_for(cfg, layout, world_size=world, engine_id=engine_id))
    except Exception as exc:  # the parent asserts on the message
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", copier.segment.info))
    muted, held, seen = False, ([], []), 0
    while True:
        if conn.poll(0.002):
            msg = conn.recv()
            if msg[0] == "exit":
                break
            if msg[0] == "jobs":
                seen += len(msg[1])
                copier.submit(msg[1])
            elif msg[0] == "mute":
                muted = msg[1]
            elif msg[0] == "fill":
                for b in range(NUM_BLOCKS):
                    row = pattern(rank, b, msg[1])
                    kv["k"][b] = torch.from_numpy(row[: REGIONS[0]])
                    kv["v"][b] = torch.from_numpy(row[REGIONS[0] :])
                conn.send(("filled", msg[1]))
            elif msg[0] == "check":
                bad = [g for g, (b, gen) in msg[1].items()
                       if not np.array_equal(np.concatenate([kv["k"][g].numpy(), kv["v"][g].numpy()]),
                                             pattern(rank, b, gen))]  # fmt: skip
                conn.send(("checked", bad, seen))
        ok, failed = copier.poll()
        held[0].extend(ok)
        held[1].extend(failed)
        if not muted and (held[0] or held[1]):
            conn.send(("done", held[0], held[1]))
            held = ([], [])
    copier.close()
    conn.send(("closed",))
