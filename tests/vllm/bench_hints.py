"""Session hints through vLLM: a chat service's conversations beside one-off traffic, with and without hints.

16 conversations of 4 turns: each turn adds 64 user tokens to the conversation, and the next turn's prompt
appends 32 "assistant" tokens (fixed here, so every run sees the same prompts) and 64 new user tokens.
Before each turn after the first, ``one_offs`` requests of 256 tokens with no session compete for a CPU
tier of 160 blocks, and vLLM's own prefix cache is reset, so what a turn finds came from the tier.
Reported: the share of turn 2-4 prompt tokens served from the tier, without hints, with hints
(``{"session": ..., "expect_followup": turn < 4, "end_session": turn == 4}``) and with room for everything
(the ceiling: every full block of the previous turn's prompt, 62.5 %).

    .venv-vllm/bin/python tests/vllm/bench_hints.py [ONE_OFFS ...]   (default 8 12 24)
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from conftest import BLOCK, cache_config, outputs, run_engine, tokens  # noqa: E402

CONVERSATIONS, TURNS, USER, ASSISTANT, ONE_OFF = 16, 4, 64, 32, 256
TIER_BLOCKS = 160
BLOCK_BYTES = 32 * 1024  # the tiny Llama's KV per 32-token block
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0"}  # pinned alike for every run compared


def prompts() -> list[list[list[int]]]:
    """prompts()[turn][conversation]: each turn's prompt extends the last one."""
    out, conv = [], [tokens(500 + c, USER) for c in range(CONVERSATIONS)]
    for t in range(TURNS):
        out.append([list(p) for p in conv])
        conv = [p + tokens(900 + 37 * c + t, ASSISTANT) + tokens(1300 + 41 * c + t, USER) for c, p in enumerate(conv)]
    return out


def ceiling() -> float:
    """The share of turn 2-4 prompt tokens that are full blocks of the previous turn's prompt."""
    turns = prompts()
    reusable = sum(len(turns[t - 1][c]) // BLOCK * BLOCK for t in range(1, TURNS) for c in range(CONVERSATIONS))
    total = sum(len(turns[t][c]) for t in range(1, TURNS) for c in range(CONVERSATIONS))
    return reusable / total


def steps(one_offs: int, hints: bool) -> list[dict]:
    out: list[dict] = []
    for t, turn in enumerate(prompts()):
        if t:
            out.append({"generate": [tokens(2000 + 97 * t + k, ONE_OFF) for k in range(one_offs)]})
            out.append({"reset": True, "retry": True})
        step: dict = {"generate": turn}
        if hints:
            step["hints_each"] = [{"session": f"chat-{c}", "expect_followup": t < TURNS - 1, "end_session": t == TURNS - 1}
                                  for c in range(CONVERSATIONS)]  # fmt: skip
        out.append(step)
    return out


def served(model: str, tmp: Path, one_offs: int, hints: bool, tier_blocks: int = TIER_BLOCKS) -> dict:
    """Run the workload once; the share of turn 2-4 prompt tokens vLLM reported cached (from the tier)."""
    cfg = cache_config(cpu=f"{tier_blocks * BLOCK_BYTES // 1024}KiB")
    report = run_engine({"model": model, "tiered_kv": cfg, "steps": steps(one_offs, hints), "max_tokens": 1,
                         "env": ENV}, tmp, timeout=600)  # fmt: skip
    resets = [s for s in report["steps"] if "reset_ok" in s]
    if not all(s["reset_ok"] for s in resets):  # else vLLM's own cache served the turns, not the tier
        raise RuntimeError(f"bench_hints: vLLM refused a prefix-cache reset: {resets}")
    conv_steps = [o for o in outputs(report) if len(o) == CONVERSATIONS][1:]
    turns = prompts()[1:]
    cached = sum(min(r["cached"], len(p)) for outs, turn in zip(conv_steps, turns, strict=True)
                 for r, p in zip(outs, turn, strict=True))  # fmt: skip
    total = sum(len(p) for turn in turns for p in turn)
    return {"served": cached / total, "counters": report["counters"]}


def main(argv: list[str]) -> None:
    from tiny_model import make_tiny_llama

    rows = [int(a) for a in argv] or [8, 12, 24]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = str(make_tiny_llama(tmp / "tiny-llama"))
        ceil = served(model, tmp, rows[-1], False, tier_blocks=4096)["served"]
        print(f"ceiling (a tier with room for everything): {ceil:.1%} (analytic {ceiling():.1%})")
        table = []
        for n in rows:
            without, with_ = (served(model, tmp, n, h)["served"] for h in (False, True))
            table.append({"one_offs": n, "without_hints": without, "with_hints": with_, "ceiling": ceil})
            print(f"{n:>3} one-off requests per turn: without hints {without:.1%}, with hints {with_:.1%} "
                  f"({with_ / ceil:.0%} of the ceiling)", flush=True)  # fmt: skip
        print(json.dumps(table))


if __name__ == "__main__":
    main(sys.argv[1:])
