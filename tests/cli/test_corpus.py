"""The bad-input corpus: every config, trace and option here once ended in a traceback, a hang or
gigabytes of RSS. The CLI must answer each with exit status 2 and exactly one line on stderr.

Most cases run ``main(argv)`` in-process (each subprocess imports torch, ~2 s); a few run the
real command in a subprocess, including the closed-pipe case that only a real pipe shows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiered_kv.cli import main

ROOT = Path(__file__).resolve().parents[2]
CORPUS = Path(__file__).resolve().parent / "corpus"
GOOD = CORPUS / "good.yaml"
BAD_CONFIGS = sorted(p.name for p in CORPUS.glob("*.yaml") if p.name != "good.yaml" and not p.name.startswith("replay_only_"))
BAD_TRACES = sorted(p.name for p in CORPUS.glob("trace_*.jsonl") if p.name != "trace_hour_long.jsonl")


@pytest.fixture(autouse=True)
def _unset_corpus_var(monkeypatch):
    monkeypatch.delenv("TIERED_KV_CORPUS_UNSET", raising=False)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    assert lines[0].startswith("tiered-kv: error: "), lines[0]
    return lines[0]


def test_corpus_is_complete():
    assert len(BAD_CONFIGS) >= 20 and len(BAD_TRACES) >= 8


@pytest.mark.parametrize("name", BAD_CONFIGS)
@pytest.mark.parametrize("command", ["check-config", "plan", "replay"])
def test_bad_config_exits_2_with_one_line(capsys, command, name):
    path = str(CORPUS / name)
    argv = ["replay", "--config", path, "--max-requests", "2", "--no-progress"] if command == "replay" else [command, path]
    assert main(argv) == 2
    line = one_error_line(capsys)
    assert name in line  # the file is named, and (below) the key or line within it
    assert any(s in line for s in ("tiers.", "gpu.", "transfer.", "model.", "replay.", "line ", "nested too deeply")), line


def test_replay_only_config_passes_check_but_replay_refuses(capsys):
    path = str(CORPUS / "replay_only_gpu_emulation_too_big.yaml")
    assert main(["check-config", path]) == 0
    capsys.readouterr()
    assert main(["replay", "--config", path, "--max-requests", "2", "--no-progress"]) == 2
    assert "gpu.num_blocks: the replay's emulated KV cache of 2147483648 blocks" in one_error_line(capsys)


@pytest.mark.parametrize("name", BAD_TRACES)
def test_bad_trace_exits_2_naming_file_and_line(capsys, name):
    argv = ["replay", "--config", str(GOOD), "--trace", str(CORPUS / name), "--max-requests", "5", "--no-progress"]
    assert main(argv) == 2
    line = one_error_line(capsys)
    assert f"{name}:" in line, line  # file:line


def test_overlong_and_overfull_lines_are_refused(tmp_path, capsys):
    """A 50 MB line (26 s and 1.2 GB before), and 2^17 + 1 hash ids on one short enough line."""
    huge = tmp_path / "huge_line.jsonl"
    ids = ",".join(["123456789"] * 5_000_000)
    huge.write_text(f'{{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [{ids}]}}\n')
    assert huge.stat().st_size > 50_000_000
    many = tmp_path / "many_ids.jsonl"
    many.write_text(json.dumps({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1] * (2**17 + 1)}) + "\n")
    for trace, fault in ((huge, "huge_line.jsonl:1: line longer than"), (many, "many_ids.jsonl:1: hash_ids has 131073 ids")):
        assert main(["replay", "--config", str(GOOD), "--trace", str(trace), "--no-progress"]) == 2
        assert fault in one_error_line(capsys)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["replay", "--metrics-port", "70000"], "--metrics-port: 70000 is not a TCP port"),
        (["replay", "--metrics-port", "0"], "--metrics-port: 0 is not a TCP port"),
        (["replay", "--metrics-port", "-1"], "--metrics-port: -1 is not a TCP port"),
        (["replay", "--metrics-port", "http"], "--metrics-port: 'http' is not a port number"),
        (["replay", "--block-bytes", "1"], "replay.block_bytes: 1 bytes is below the minimum of 512"),
        (["replay", "--speed", "nan"], "replay.speed"),
        (["replay", "--speed", "-1"], "replay.speed"),
        (["replay", "--max-requests", "many"], "--max-requests: invalid int value"),
        (["replay", "--trace", str(CORPUS / "trace_hour_long.jsonl"), "--speed", "1e-9"], "replay.speed: 1e-09 would pace"),
        (["replay", "--trace", "/nonexistent/trace.jsonl"], "trace file not found"),
        (["plan", "/nonexistent/config.yaml"], "cannot read config"),
        (["check-config"], "the following arguments are required: config"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "the following arguments are required: command"),
    ],
)
def test_bad_options_exit_2_with_one_line(capsys, argv, expected):
    if argv[:1] == ["replay"] and "--config" not in argv:
        argv = [*argv, "--config", str(GOOD), "--no-progress"]
    assert main(argv) == 2
    assert expected in one_error_line(capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present: the GPU bench runs")
def test_bench_only_gpu_without_cuda_says_so(capsys):
    assert main(["bench", "--quick", "--only", "gpu"]) == 2
    assert "bench --only gpu: needs CUDA" in one_error_line(capsys)


def test_check_config_json_reports_the_error_on_stdout(capsys):
    assert main(["check-config", "--json", str(CORPUS / "gpu_device_banana.yaml")]) == 2
    out = capsys.readouterr()
    assert out.err == "" and "gpu.device" in json.loads(out.out)["error"]


# -- the real command in a subprocess -------------------------------------------------------------
def _cli(*argv: str, **kw) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("TIERED_KV_CORPUS_UNSET", None)
    return subprocess.Popen([sys.executable, "-m", "tiered_kv.cli", *argv], cwd=ROOT, env=env,
                            stderr=subprocess.PIPE, **kw)


@pytest.mark.slow
def test_real_command_closed_pipe_and_bad_input():
    """Through ``python -m tiered_kv.cli``, started together (each imports torch, ~2 s):
    ``... | head`` with the reader gone before the first write (no traceback, status 141), a
    bad config and a bad option (status 2, one line)."""
    r, w = os.pipe()
    os.close(r)  # the write gets EPIPE (Python ignores SIGPIPE, so it raises BrokenPipeError)
    try:
        piped = _cli("check-config", "configs/default.yaml", stdout=w)
    finally:
        os.close(w)
    bad = {
        "config": _cli("check-config", str(CORPUS / "yaml_duplicate_nested.yaml"), stdout=subprocess.DEVNULL),
        "option": _cli("replay", "--config", str(GOOD), "--metrics-port", "70000", stdout=subprocess.DEVNULL),
    }
    _, err = piped.communicate(timeout=300)
    assert err == b"", err.decode()  # no traceback, no "Exception ignored" at interpreter exit
    assert piped.returncode == 141
    lines = {}
    for name, proc in bad.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, (name, err.decode())
        lines[name] = err.decode().splitlines()
    assert lines["config"] == [
        f"tiered-kv: error: {CORPUS / 'yaml_duplicate_nested.yaml'}: invalid YAML: line 6, column 5: "
        "duplicate key 'capacity' (first given at line 4)"
    ]
    assert lines["option"] == [
        "tiered-kv: error: replay: argument --metrics-port: 70000 is not a TCP port (1-65535) "
        "(see tiered-kv replay --help)"
    ]
