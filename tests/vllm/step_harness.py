"""Drive the connector's real scheduler and worker halves step by step, the way vLLM 0.32 calls them.

No engine and no model: one process, a host-engine worker over small CPU tensors, and a scheduler
half over the same shared segment. ``Harness.step`` plays one engine step in vLLM's order:

  scheduler: get_num_new_matched_tokens / update_state_after_alloc (``admit``) ... build_connector_meta
  worker:    handle_preemptions -> start_load_kv (before the forward: the step has a synchronous load,
             as vLLM orders it) -> forward -> wait_for_save -> get_finished -> load errors -> worker meta
  scheduler: update_connector_output

The "forward" writes each scheduled token's position of its block with a value derived from the
token (what a block's KV is, here), after a short sleep, so a store issued before it reads zeros.
Only our own objects are real; vLLM's inputs are plain namespaces with the attributes the halves read.
"""

from __future__ import annotations

import itertools
import time
from types import SimpleNamespace as NS

import torch
from packed_kv import BS, NB, WIDTH, vllm_kv_caches  # tests/vllm is on sys.path
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

from tiered_kv.integrations.vllm.scheduler_half import SchedulerHalf
from tiered_kv.integrations.vllm.worker_half import WorkerHalf

_ENGINES = itertools.count()


def token_values(tokens: list[int]) -> torch.Tensor:
    """What the forward writes for these tokens at their positions: [len, 2, WIDTH]."""
    t = torch.tensor(tokens, dtype=torch.float32)[:, None, None]
    return t * 1000 + torch.arange(2 * WIDTH, dtype=torch.float32).reshape(1, 2, WIDTH)


def request(rid: str, prompt: list[int], **extra) -> NS:
    return NS(request_id=rid, prompt_token_ids=list(prompt), block_hashes=None, kv_transfer_params=None,
              lora_request=None, cache_salt=None, mm_features=None, prompt_embeds=None, **extra)  # fmt: skip


class Harness:
    def __init__(
        self,
        tmp_path,
        *,
        cpu: str = "64KiB",
        forward_s: float = 0.02,
        inflight: str | None = None,
        disk: str | None = None,
        extra: dict | None = None,
        layers: int = 1,
        kv_layout: str | None = None,
        pad: int = 0,
        kv_groups: list | None = None,
        engine_kv: tuple | None = None,
        spill: str | None = None,
    ) -> None:
        names = [f"layer.{i}" for i in range(layers)]
        if kv_groups is not None:  # several KV cache groups (vLLM's specs, their own block sizes), one layer each
            names = [name for g in kv_groups for name in g.layer_names]
        if kv_layout is None:  # one tensor per layer, a config without placements
            self.kv = {n: torch.zeros(NB, BS, 2, WIDTH) for n in names}  # block, token, K/V, width
            registered = self.kv
            bpb = BS * 2 * WIDTH * 4
            self.kcc = NS(num_blocks=NB, kv_cache_tensors=[NS(size=NB * bpb, shared_by=[n]) for n in names],
                          kv_cache_groups=[KVCacheGroupSpec(names, FullAttentionSpec(
                              block_size=BS, num_kv_heads=1, head_size=WIDTH, dtype=torch.float32))])  # fmt: skip
        else:  # vLLM's own placements and views (packed_kv.py), the harness writing through [block, token, K/V, width]
            self.kcc, registered = vllm_kv_caches(names, kv_layout, pad=pad, groups=kv_groups)
            self.kv = {n: t[:, 0].unflatten(-1, (2, WIDTH)) for n, t in registered.items()}
        # Each layer's group (its position in a block-ids tuple) and tokens per block.
        self.layer_group = {n: next(i for i, g in enumerate(self.kcc.kv_cache_groups) if n in g.layer_names)
                            for n in self.kv}  # fmt: skip
        self.layer_bs = {n: self.kcc.kv_cache_groups[i].kv_cache_spec.block_size for n, i in self.layer_group.items()}
        self.vcfg = NS(cache_config=NS(block_size=BS), model_config=NS(model="harness", revision=None),
                       parallel_config=NS(tensor_parallel_size=1, pipeline_parallel_size=1),
                       kv_events_config=None)  # fmt: skip
        sched_kcc = self.kcc
        if engine_kv is not None:  # a real model's (vllm_config, worker config, scheduler config, views): the
            self.vcfg, self.kcc, sched_kcc, registered = engine_kv  # test writes the KV itself (no forward)
            self.kv, self.layer_group, self.layer_bs = {}, {}, {}
        self.registered = registered  # what the worker half was handed
        shm = tmp_path / "shm"
        shm.mkdir(mode=0o700, exist_ok=True)
        self.extra = {"config": {"tiers": {"cpu": {"capacity": cpu, "pin_memory": "off", "shared_path": str(shm)},
                                           "disk": {"enabled": False}},
                                 "transfer": {"engine": "host"}}}  # fmt: skip
        if disk is not None:  # a disk tier of this capacity under tmp_path
            tiers = self.extra["config"]["tiers"]
            tiers["disk"] = {"enabled": True, "path": str(tmp_path / "disk"), "capacity": disk}
            if spill is not None:
                tiers["disk"]["spill_policy"] = spill
        self.extra.update(extra or {})  # kv_connector_extra_config's other keys
        if inflight is not None:  # transfer.max_inflight_bytes
            self.extra["config"]["transfer"]["max_inflight_bytes"] = inflight
        eid = f"harness-{next(_ENGINES)}-{time.monotonic_ns()}"
        self.worker = WorkerHalf(self.vcfg, self.kcc, self.extra, eid)
        self.worker.register(registered)
        self.sched = SchedulerHalf(self.vcfg, sched_kcc, self.extra, eid)
        self.sched.on_handshake({0: self.worker.handshake()})
        self.forward_s = forward_s
        self.fail_sync_loads = False
        self.metas: list = []
        self.load_errors: list[set[int]] = []
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()
        self._finished: set[str] = set()

    # -- the scheduler's admission of a waiting request --------------------------------------
    def admit(self, req: NS, block_ids: list[int], num_computed: int = 0) -> tuple[int | None, bool]:
        self.sched.on_new_request(req)
        n, is_async = self.sched.matched_tokens(req, num_computed)
        if n:
            self.sched.after_alloc(req, NS(get_block_ids=lambda: per_group(block_ids)), n)
        return n, is_async

    def finish(self, req: NS) -> bool:
        """vLLM's request_finished; the id reaches the workers in the next step's finished_req_ids."""
        delay = self.sched.request_finished(req)
        self._finished.add(req.request_id)
        return delay

    # -- one engine step -----------------------------------------------------------------------
    def step(self, new=(), cached=(), preempted=(), finished=(), resumed=(), report: bool = True) -> NS:
        """``new``: (req, block_ids, num_computed, num_scheduled); ``cached``: (rid, new_block_ids or None,
        num_computed, num_scheduled); ``finished``: ids vLLM reports finished this step; ``report=False``
        holds the worker's report back a step (its jobs stay in flight at the scheduler)."""
        so = NS(preempted_req_ids=set(preempted),
                scheduled_new_reqs=[NS(req_id=r.request_id, prompt_token_ids=r.prompt_token_ids, block_ids=per_group(b),
                                       num_computed_tokens=c) for r, b, c, _ in new],
                scheduled_cached_reqs=NS(req_ids=[c[0] for c in cached],
                                         new_block_ids=[None if c[1] is None else per_group(c[1]) for c in cached],
                                         num_computed_tokens=[c[2] for c in cached], resumed_req_ids=set(resumed)),
                num_scheduled_tokens={**{r.request_id: s for r, _, _, s in new}, **{c[0]: c[3] for c in cached}},
                finished_req_ids=set(finished))  # fmt: skip
        meta = self.sched.build_meta(so)
        self.metas.append(meta)
        finished, self._finished = set(finished) | self._finished, set()
        w = self.worker
        w.handle_preemptions(meta)
        w.start(meta)  # before the forward (vLLM does so whenever the step has a synchronous load)
        self._forward(new, cached)
        w.save()
        sending, recving = w.finished(set(finished))
        self.finished_sending |= sending
        self.finished_recving |= recving
        self.load_errors.append(w.load_errors())
        if not report:
            return meta
        report = w.worker_meta()
        if self.fail_sync_loads and report is not None:  # this rank's copies of them failed
            for rank, (ok, failed) in report.reports.items():
                report.reports[rank] = ([j for j in ok if j not in meta.sync_loads],
                                        failed + [j for j in ok if j in meta.sync_loads])  # fmt: skip
        self.sched.update_output(NS(kv_connector_worker_meta=report))
        return meta

    def _forward(self, new, cached) -> None:
        time.sleep(self.forward_s)  # a forward takes a while: a store issued before it reads zeros
        todo = [(r.prompt_token_ids, b, c, s) for r, b, c, s in new]
        for rid, _, c, s in cached:
            req = self.sched._reqs.get(rid)
            if req is not None:
                todo.append((req.prompt, req.block_ids, c, s))
        # Layer by layer, in vLLM's order: the layer's new KV is written (unified_kv_cache_update), then its
        # attention waits for its loads (wait_for_layer_load) and reads the layer (``after_start``).
        self.after_start = {}
        for i, (name, t) in enumerate(self.kv.items()):
            for prompt, blocks, computed, scheduled in todo:
                self.write(prompt, blocks, computed, computed + scheduled, layer=i)
            self.worker.wait_layer(name)
            self.after_start[name] = t.clone()

    def write(self, prompt: list[int], blocks, start: int, end: int, layer: int | None = None) -> None:
        """The forward's KV of positions [start, end): layer i holds the token's values + i / 4, in the blocks
        of its group (``blocks``: one group's ids, or a tuple of every group's)."""
        end = min(end, len(prompt))
        if end <= start:
            return
        vals = token_values(prompt[start:end])
        ids = per_group(blocks)
        for i, (name, t) in enumerate(self.kv.items()):
            if layer is not None and i != layer:
                continue
            bs, table = self.layer_bs[name], ids[self.layer_group[name]]
            for pos in range(start, min(end, len(table) * bs)):
                t[table[pos // bs], pos % bs] = vals[pos - start] + i / 4

    def holds(self, prompt: list[int], blocks, n_blocks: int, kv=None, first: int = 0) -> bool:
        """Whether blocks ``[first, n_blocks)`` of ``blocks`` hold the prompt's KV (a group's, with several)."""
        kv = kv if kv is not None else self.kv
        ids = per_group(blocks)
        ok = []
        for i, (name, t) in enumerate(kv.items()):
            bs, table = self.layer_bs[name], ids[self.layer_group[name]] if len(ids) > 1 else ids[0]
            want = token_values(prompt[first * bs : n_blocks * bs]).reshape(n_blocks - first, bs, 2, WIDTH)
            got = torch.stack([t[b] for b in table[first:n_blocks]])
            ok.append(torch.equal(got, want + i / 4))
        return all(ok)

    def idle(self, n: int = 3) -> None:
        """Empty steps (vLLM keeps stepping while the connector has jobs in flight)."""
        for _ in range(n):
            self.step()
            time.sleep(0.01)

    def counters(self) -> dict:
        return dict(self.sched.counters)

    def close(self) -> None:
        self.sched.close()
        self.worker.close()


def per_group(blocks) -> tuple[list[int], ...]:
    """Block ids per KV cache group: ``[ids]`` for one group, or already a tuple of every group's lists."""
    if isinstance(blocks, tuple) or (blocks and isinstance(blocks[0], list)):
        return tuple(list(b) for b in blocks)
    return (list(blocks),)


def store_prompt(h: Harness, rid: str, prompt: list[int], blocks) -> None:
    """A miss: ``prompt`` computed into ``blocks`` and stored, its request finished, every job landed."""
    req = request(rid, prompt)
    assert h.admit(req, blocks) == (0, False)
    h.step(new=[(req, blocks, 0, len(prompt))])
    h.idle()
    h.finish(req)
    h.idle()
