from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiered_kv as tkv
from tiered_kv.sizes import parse_size

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4096", 4096), ("512MiB", 512 << 20), ("32GiB", 32 << 30), ("1.5TB", 1_500_000_000_000), ("2 KiB", 2048), (7, 7)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["-5MiB", "12XB", "", "1.5B", True, None, [], -3, float("nan"), "1e3"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


@pytest.mark.parametrize("name", ["default.yaml", "cpu-only.yaml"])
def test_shipped_configs_load(name):
    cfg = tkv.load_config(ROOT / "configs" / name)
    assert cfg.bytes_per_block > 0
    assert cfg.tiers.cpu.capacity // cfg.bytes_per_block >= 1


def test_default_yaml_documents_every_key():
    """Every key of the model appears in default.yaml with a comment."""
    text = (ROOT / "configs" / "default.yaml").read_text()
    data = yaml.safe_load(text)
    full = tkv.load_config({}).model_dump()

    def walk(model: dict, data: dict, prefix: str):
        for key, value in model.items():
            if key == "bytes_per_block" and prefix == ".model":
                continue  # documented as the alternative to the geometry
            assert key in data, f"{prefix}.{key} missing from default.yaml"
            if isinstance(value, dict):
                walk(value, data[key], f"{prefix}.{key}")

    walk(full, data, "")
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#") and not stripped.endswith(":"):
            assert "#" in line, f"undocumented line: {line!r}"


@pytest.mark.parametrize(
    ("data", "dotted"),
    [
        ({"tiers": {"cpu": {"capcity": "1GiB"}}}, "tiers.cpu.capcity: unknown key"),
        ({"tierz": {}}, "tierz: unknown key"),
        ({"tiers": {"cpu": {"capacity": "-5MiB"}}}, "tiers.cpu.capacity"),
        ({"tiers": {"cpu": {"capacity": "lots"}}}, "tiers.cpu.capacity"),
        ({"tiers": {"cpu": {"capacity": 1000}}}, "tiers.cpu.capacity: 1000 bytes"),
        ({"gpu": {"num_blocks": "8"}}, "gpu.num_blocks"),
        ({"gpu": {"num_blocks": 0}}, "gpu.num_blocks"),
        ({"eviction": {"policy": "fifo"}}, "eviction.policy"),
        ({"model": {"num_layers": 2}}, "model: missing num_kv_heads, head_dim"),
        ({"tiers": {"disk": {"enabled": True, "path": "/proc/version"}}}, "tiers.disk.path"),
        ({"tiers": {"disk": {"enabled": True, "capacity": 10, "path": "/tmp"}}}, "tiers.disk.capacity: 10 bytes"),
    ],
)
def test_errors_name_the_dotted_key(data, dotted):
    with pytest.raises(tkv.ConfigError) as info:
        tkv.load_config(data)
    assert dotted in str(info.value)


def test_capacity_smaller_than_block_names_bytes_per_block():
    with pytest.raises(tkv.ConfigError, match=r"bytes_per_block = 262144"):
        tkv.load_config({"model": {"bytes_per_block": "256KiB"}, "tiers": {"cpu": {"capacity": "100KiB"}}})


def test_geometry_derives_bytes_per_block():
    cfg = tkv.load_config(
        {"model": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16", "block_tokens": 16}}
    )
    assert cfg.bytes_per_block == 2 * 32 * 8 * 128 * 2 * 16


def test_unwritable_disk_path(tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    os.chmod(target, 0o500)
    try:
        if os.access(target, os.W_OK):
            pytest.skip("running as a user that can write a 0500 directory (root)")
        with pytest.raises(tkv.ConfigError, match="tiers.disk.path"):
            tkv.load_config({"tiers": {"disk": {"enabled": True, "path": str(target)}}})
    finally:
        os.chmod(target, 0o700)


def test_missing_but_creatable_disk_path_is_fine(tmp_path):
    cfg = tkv.load_config({"model": {"model_id": "m", "bytes_per_block": 4096}, "tiers": {"disk": {"enabled": True, "path": str(tmp_path / "a" / "b")}}})
    assert cfg.tiers.disk.path.endswith("b")
    assert not (tmp_path / "a").exists()  # validation has no side effects


def test_file_errors(tmp_path):
    with pytest.raises(tkv.ConfigError, match="cannot read"):
        tkv.load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: [unclosed\n")
    with pytest.raises(tkv.ConfigError, match="invalid YAML"):
        tkv.load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(tkv.ConfigError, match="top level must be a mapping"):
        tkv.load_config(scalar)


def test_dict_and_empty_file(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert tkv.load_config(empty) == tkv.load_config({})


_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.text(max_size=12), st.sampled_from(["512MiB", "-1GiB", "1.5TB", "lru", "arc", "write_back", "x" * 3]),
)
_keys = st.sampled_from(
    ["model", "tiers", "cpu", "disk", "capacity", "path", "gpu", "num_blocks", "policy", "eviction", "bytes_per_block",
     "num_layers", "enabled", "replay", "keys", "hash", "transfer", "dtype", "junk"]
)
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_keys, inner, max_size=4), max_leaves=12)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.dictionaries(_keys, _values, max_size=5))
def test_property_random_dicts_only_raise_config_error(data):
    try:
        tkv.load_config(data)
    except tkv.ConfigError:
        pass


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(max_size=200))
def test_property_random_yaml_text_only_raises_config_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("y") / "c.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        tkv.load_config(path)
    except tkv.ConfigError:
        pass


def test_disk_tier_refuses_the_placeholder_model_id(tmp_path):
    disk = {"enabled": True, "path": str(tmp_path / "d")}
    with pytest.raises(tkv.ConfigError, match="model.model_id.*placeholder 'demo-model'"):
        tkv.load_config({"tiers": {"disk": disk}})
    ok = tkv.load_config({"model": {"allow_placeholder_id": True, "bytes_per_block": 4096}, "tiers": {"disk": disk}})
    assert ok.model.model_id == "demo-model"
    assert tkv.load_config({}).tiers.disk.enabled is False  # no disk tier: the placeholder is harmless
