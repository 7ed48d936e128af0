"""`tiered-kv disk ls|gc PATH` over namespaces written by a real cache."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from disk_helpers import put

import tiered_kv as tkv
from tiered_kv.cli import main
from tiered_kv.tiers.disk import DiskNamespace, DiskStore


async def _write_blocks(path, model_id: str) -> None:
    kv = {"kv": torch.zeros(8, 512, dtype=torch.uint8)}
    cfg = {
        "model": {"bytes_per_block": 512, "model_id": model_id},
        "gpu": {"num_blocks": 8},
        "tiers": {
            "cpu": {"capacity": 4 * 512, "pin_memory": "off"},
            "disk": {"enabled": True, "path": str(path), "capacity": 16 * 512, "spill_policy": "write_through"},
        },
    }
    async with tkv.TieredKVCache(cfg, tkv.KVLayout.from_tensors(kv, 8)) as cache:
        await cache.store(cache.keyer.keys_for_block_ids(range(3)), [0, 1, 2])


async def test_disk_ls_and_gc(tmp_path, capsys):
    await _write_blocks(tmp_path, "model-a")
    await _write_blocks(tmp_path, "model-b")
    assert main(["disk", "ls", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(r["model_id"] for r in rows) == ["model-a", "model-b"]
    assert all(r["blocks"] == 3 and r["bytes_per_block"] == 512 for r in rows)
    victim = next(r["dirname"] for r in rows if r["model_id"] == "model-a")
    assert main(["disk", "gc", str(tmp_path), victim, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == [victim]
    assert main(["disk", "ls", str(tmp_path), "--json"]) == 0
    assert [r["model_id"] for r in json.loads(capsys.readouterr().out)] == ["model-b"]
    assert main(["disk", "gc", str(tmp_path), "ns-does-not-exist"]) == 2
    assert main(["disk", "ls", str(tmp_path / "missing")]) == 2
    (tmp_path / "not-ours").mkdir()
    assert main(["disk", "gc", str(tmp_path), "--all", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["removed"]) == 1
    assert (tmp_path / "not-ours").is_dir()  # never touches directories that are not namespaces


# ---- what ls prints, and what gc can remove -----------------------------------------------------------
async def make_ns(root, model_id: str = "model-x", dtype: str = "float16") -> str:
    ns = DiskNamespace(model_id, dtype, "layout-1", 3096, 32)
    async with DiskStore(root, ns, 4) as store:
        await put(store, [0], [hashlib.sha256(model_id.encode()).digest()])
    return ns.dirname()


EVIL_MODEL = "evil\x1b[31mRED\x1b[0m\x07[bold]x[/bold]\u202e\r\n"


async def test_ls_escapes_terminal_control_characters(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one line per row: the escaped text is not folded
    name = await make_ns(tmp_path, EVIL_MODEL, "f16\x1b]0;pwned\x07")
    assert main(["disk", "ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert not set(out) & {"\x1b", "\x07", "\u202e", "\r"}, repr(out)
    assert "evil\\x1b[31mRED\\x1b[0m\\x07[bold]x[/bold]\\u202e\\r\\n" in out  # visible, and not rich markup
    assert "f16\\x1b]0;pwned\\x07" in out and name in out
    assert main(["disk", "ls", str(tmp_path), "--json"]) == 0
    raw = capsys.readouterr().out
    assert "\x1b" not in raw and json.loads(raw)[0]["model_id"] == EVIL_MODEL
    assert main(["disk", "gc", str(tmp_path), "ns-\x1b[2Jgone"]) == 2  # names from the command line too
    err = capsys.readouterr().err
    assert "\x1b" not in err and "ns-\\x1b[2Jgone" in err


async def test_ls_prints_the_whole_namespace_name_on_a_narrow_terminal(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "50")
    name = await make_ns(tmp_path, "meta-llama/Llama-3.1-70B-Instruct-with-a-long-name")
    assert main(["disk", "ls", str(tmp_path)]) == 0
    assert name in capsys.readouterr().out  # what `disk gc` needs, uncut
    assert main(["disk", "gc", str(tmp_path), name]) == 0
    assert not (tmp_path / name).exists()


GARBAGE = {
    "not_json": b"{not json",
    "not_utf8": b"\xff\xfe\x00",
    "a_list": b"[1, 2]",
    "no_format": b'{"model_id": "x"}',
    "bad_fields": b'{"format": "tiered_kv.disk", "format_version": 1, "model_id": 5}',
    "deeply_nested": b"[" * 100_000,
}


@pytest.mark.parametrize("how", ["by_name", "all"])
@pytest.mark.parametrize("garbage", list(GARBAGE))
async def test_gc_removes_a_namespace_whose_json_is_garbage(tmp_path, capsys, garbage, how):
    name = await make_ns(tmp_path, "model-a")
    keep = await make_ns(tmp_path / "elsewhere", "model-b")  # a valid one in another root: untouched
    foreign = tmp_path / "ns-00000000000000000000"  # our name pattern, another program's file: never ours
    foreign.mkdir()
    (foreign / "namespace.json").write_text('{"format": "other-tool", "format_version": 1}')
    (tmp_path / name / "namespace.json").write_bytes(GARBAGE[garbage])
    assert main(["disk", "ls", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["dirname"] for r in rows] == [name] and rows[0]["problem"]
    assert main(["disk", "ls", str(tmp_path)]) == 0
    assert "damaged" in capsys.readouterr().out
    argv = ["disk", "gc", str(tmp_path), *([name] if how == "by_name" else ["--all"]), "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == [name]
    assert not (tmp_path / name).exists()
    assert (foreign / "namespace.json").exists() and (tmp_path / "elsewhere" / keep).is_dir()
    assert main(["disk", "gc", str(tmp_path), foreign.name]) == 2  # not listed, so not removable


async def test_special_namespace_json_neither_hangs_nor_tracebacks(tmp_path, capsys):
    """A FIFO there is damage gc can remove (without opening it for a blocking read); a directory
    there is refused with one line (exit 2)."""
    fifo_ns = await make_ns(tmp_path, "model-fifo")
    dir_ns = await make_ns(tmp_path, "model-dir")
    os.unlink(tmp_path / fifo_ns / "namespace.json")
    os.mkfifo(tmp_path / fifo_ns / "namespace.json")
    os.unlink(tmp_path / dir_ns / "namespace.json")
    os.mkdir(tmp_path / dir_ns / "namespace.json")
    assert main(["disk", "ls", str(tmp_path), "--json"]) == 0
    problems = {r["dirname"]: r["problem"] for r in json.loads(capsys.readouterr().out)}
    assert set(problems) == {fifo_ns, dir_ns} and all("regular file" in p for p in problems.values())
    assert main(["disk", "gc", str(tmp_path), dir_ns]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "directories" in err and "Traceback" not in err
    assert main(["disk", "gc", str(tmp_path), fifo_ns]) == 0
    assert not (tmp_path / fifo_ns).exists() and (tmp_path / dir_ns).is_dir()
