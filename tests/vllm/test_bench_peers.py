"""The peers bench's own logic, without vLLM: its script and the reading of it, medians and ratios,
the table, the /dev/shm sweep, and that what it starts dies with it (runs in the normal suite)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from peer_procs import ShmSweep, group, held_paths, open_paths, run_engine  # noqa: E402
from peer_stats import ENGINES, order, plan, rows, samples, summarise, table  # noqa: E402


def fake_report(steps: list[dict], wall: dict[str, float], cached: int, token: dict | None = None) -> dict:
    """What peer_engine.py would print for ``steps``: one entry per generate, walls (and first tokens) per kind."""
    token = token or {}
    out: list[dict] = [{"start_s": 1.0, "reset_failures": 2}]
    seen: dict[str, int] = {}
    for s in steps:
        if "generate" not in s:
            continue
        n = len(s["generate"])
        if n > 1:  # a no-hit batch: 32 output tokens each
            out.append({"outputs": [{"tokens": [5] * s["max_tokens"], "cached": 0}] * n, "wall_s": wall["nohit"]})
            continue
        p = tuple(s["generate"][0])
        k = seen.get(p, 0)  # the first, second and third run of one prompt
        seen[p] = k + 1
        kind = ("warm", "recompute", "offload", "gpu")[0 if len(p) == 4 else 1 + k]
        res = {"tokens": [token.get(kind, 5)], "cached": cached if kind == "offload" else 0}
        out.append({"outputs": [res], "wall_s": wall[kind]})
    return {"steps": out}


def test_plan_is_read_back_by_tag_not_position():
    ttft = [[10 + r] * 8 for r in range(2)]
    nohit = [[[100 + 10 * r + i] * 3 for i in range(4)] for r in range(2)]
    steps, tags = plan(ttft, nohit, warm=[1, 2, 3, 4])
    assert tags == ["warm", "recompute", "offload", "gpu", "recompute", "offload", "gpu", "nohit", "nohit"]
    # the offload hit comes after a reset, vLLM's own GPU hit right after it without one
    gens = [i for i, s in enumerate(steps) if "generate" in s]
    assert any("reset" in s for s in steps[gens[1] : gens[2]]) and "sleep" in str(steps[gens[1] : gens[2]])
    assert not any("reset" in s for s in steps[gens[2] : gens[3]])
    assert all(steps[i]["max_tokens"] == 32 for i in gens[-2:])
    wall = {"warm": 9.0, "recompute": 0.5, "offload": 0.04, "gpu": 0.03, "nohit": 2.0}
    s = samples(fake_report(steps, wall, cached=959), tags)
    assert s["recompute"] == [500.0, 500.0] and s["offload"] == [40.0, 40.0] and s["gpu"] == [30.0, 30.0]
    assert s["offload_cached"] == [959, 959]
    assert s["nohit_tok_s"] == [4 * 32 / 2.0] * 2  # output tokens over the batch's wall time
    assert s["wrong_tokens"] == [0, 0, 0, 0] and s["reset_failures"] == [2]
    # an offload hit that serves the wrong KV shows as another greedy token than the recompute's
    s = samples(fake_report(steps, wall, cached=959, token={"offload": 7}), tags)
    assert s["wrong_tokens"] == [1, 0, 1, 0] and summarise({"lmcache": s})["lmcache"]["wrong_tokens"] == 2
    # a hit measured after a reset vLLM refused may be vLLM's own: not counted, but counted as dropped
    report = fake_report(steps, {**wall, "offload": 0.01}, cached=928)
    gens = [g for g in report["steps"] if "outputs" in g]
    gens[tags.index("offload")]["after_failed_reset"] = True
    s = samples(report, tags)
    assert s["offload"] == [10.0] and s["offload_cached"] == [928] and s["unreset"] == [1]
    assert s["wrong_tokens"] == [0, 0, 0]
    with pytest.raises(ValueError, match="3 generate steps, the script has 9"):
        samples({"steps": fake_report(steps, wall, 0)["steps"][:4]}, tags)


def test_summary_takes_medians_and_the_ratio_to_no_connector():
    per = {
        "none": {"recompute": [400, 500, 450], "offload": [410, 420, 430], "gpu": [40, 41, 42],
                 "offload_cached": [0, 0, 0], "nohit_tok_s": [300, 200, 250]},
        "tiered_kv": {"recompute": [430, 440, 900], "offload": [30, 90, 36], "gpu": [40, 40, 40],
                      "offload_cached": [928, 928, 928], "nohit_tok_s": [240, 245, 1000]},
        "lmcache": {"recompute": [450, 450, 450], "offload": [31, 32, 33], "gpu": [39, 39, 39],
                    "offload_cached": [959, 959, 959], "nohit_tok_s": [225, 230, 235]},
    }  # fmt: skip
    med = summarise(per)
    assert med["tiered_kv"]["offload"] == 36 and med["tiered_kv"]["recompute"] == 440
    assert med["none"]["nohit_ratio"] == 1.0
    assert med["tiered_kv"]["nohit_ratio"] == pytest.approx(245 / 250)  # medians, one outlier ignored
    assert med["lmcache"]["nohit_ratio"] == pytest.approx(230 / 250)
    assert med["lmcache"]["rounds"] == 3
    r = rows(med, tp=2)
    assert [c[1] for c in r][:2] == ["TTFT recompute", "TTFT offload hit (cached tokens)"]
    assert r[1][2:] == ["-", "36.0 ms (928)", "32.0 ms (959)"]  # no offload tier without a connector
    assert r[4][2:] == ["1.000", "0.980", "0.920"] and all(c[0] == "TP=2" for c in r)
    assert table(r, "t").row_count == len(r)


def test_summary_without_the_no_connector_engine_gives_no_ratio():
    med = summarise({"lmcache": {"recompute": [1.0], "nohit_tok_s": [100.0]}})
    assert med["lmcache"]["nohit_ratio"] is None
    assert rows(med, 1)[4][2:] == ["-", "-", "-"]


def test_engine_order_rotates_so_each_engine_runs_first_once():
    orders = [order(p) for p in range(3)]
    assert all(sorted(o) == sorted(ENGINES) for o in orders)
    assert {o[0] for o in orders} == set(ENGINES)


def test_sweep_removes_only_new_unheld_entries_of_its_prefixes(tmp_path):
    (tmp_path / "lmcache_kv_old").write_bytes(b"x")  # there before: someone else's
    sweep = ShmSweep(tmp_path, min_age_s=0)
    for name in ("lmcache_kv_a", "vllm_dist_b", "tkv-0.lock", "other"):
        (tmp_path / name).write_bytes(b"x")
    held = tmp_path / "lmcache_kv_held"
    held.write_bytes(b"x")
    # a live process (not this one: a real other holder) keeps one open
    holder = subprocess.Popen([sys.executable, "-c", f"f = open({str(held)!r}); import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 10
        while str(held) not in open_paths(holder.pid):  # its fds come and go while Python starts
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert sorted(sweep.sweep()) == ["lmcache_kv_a", "vllm_dist_b"]
    finally:
        holder.kill()
        holder.wait()
    assert sorted(os.listdir(tmp_path)) == ["lmcache_kv_held", "lmcache_kv_old", "other", "tkv-0.lock"]
    assert sweep.sweep() == ["lmcache_kv_held"]  # its holder is gone
    assert sorted(sweep.removed) == ["lmcache_kv_a", "lmcache_kv_held", "vllm_dist_b"]


def test_a_process_whose_other_fd_vanished_still_holds_its_entry(tmp_path):
    # /proc/<pid>/fd as the sweep reads it: fd 3 closed between the listing and its readlink (here: not a
    # link, so readlink fails as it does for a vanished one), fd 4 still the shm entry.
    fds = tmp_path / "proc" / "4242" / "fd"
    fds.mkdir(parents=True)
    (fds / "3").write_bytes(b"")
    (fds / "4").symlink_to("/dev/shm/lmcache_kv_x")
    assert held_paths(tmp_path / "proc") == {"/dev/shm/lmcache_kv_x"}


def test_sweep_leaves_a_fresh_entry_another_engine_may_not_have_mapped_yet(tmp_path):
    sweep = ShmSweep(tmp_path, min_age_s=30)
    (tmp_path / "vllm_dist_new").write_bytes(b"x")
    assert sweep.sweep() == []
    old = time.time() - 60
    os.utime(tmp_path / "vllm_dist_new", (old, old))
    assert sweep.sweep() == ["vllm_dist_new"]


def child_pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}/stat").exists() else ""
    return bool(stat) and stat.split(") ", 1)[1][0] != "Z"


def test_a_failure_inside_the_group_kills_the_leader_and_its_children(tmp_path):
    pidfile = tmp_path / "child.pid"
    # the leader starts a child (as vLLM starts its EngineCore) that ignores SIGTERM, then says its pid
    child = (f"import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             f"open({str(pidfile)!r} + '.tmp', 'w').write(str(os.getpid())); "
             f"os.replace({str(pidfile)!r} + '.tmp', {str(pidfile)!r}); time.sleep(120)")
    code = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(120)"
    with pytest.raises(RuntimeError, match="bench failed"):
        with group([sys.executable, "-c", code]) as proc:
            deadline = time.monotonic() + 20
            while not pidfile.exists():
                assert time.monotonic() < deadline
                time.sleep(0.05)
            raise RuntimeError("bench failed")
    assert proc.poll() is not None
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while child_pid_alive(child):
        assert time.monotonic() < deadline, "the grandchild outlived the bench"
        time.sleep(0.05)


def test_run_engine_returns_the_report_or_raises_with_the_output(tmp_path):
    ok = 'import json; print("noise"); print("ENGINE_REPORT " + json.dumps({"steps": [{"start_s": 1}]}))'
    assert run_engine([sys.executable, "-c", ok], 30, cwd=tmp_path) == {"steps": [{"start_s": 1}]}
    bad = 'import sys; print("ENGINE_REPORT {}"); sys.stderr.write("boom"); sys.exit(3)'
    with pytest.raises(RuntimeError, match="exited 3 without a report:\nboom"):
        run_engine([sys.executable, "-c", bad], 30, cwd=tmp_path)
    with pytest.raises(RuntimeError, match="still running after 1 s"):
        run_engine([sys.executable, "-c", "import time; time.sleep(30)"], 1, cwd=tmp_path)
