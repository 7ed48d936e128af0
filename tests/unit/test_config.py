from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiered_kv as tkv
from tiered_kv import config as config_module
from tiered_kv import host_checks
from tiered_kv.host_checks import mem_available
from tiered_kv.policy import GHOST_BYTES_PER_SLOT
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


# -- issue 9: values check-config used to accept and a replay or cache then choked on ----------------
MIB64 = {"bytes_per_block": "64MiB"}  # few slots, so a capacity check is about bytes, not slot counts


@pytest.mark.parametrize("bad", [10**30, 1e30, "1000000000000000000000000000000", "2000000TiB", 2**60 + 1, "9" * 5000])
def test_parse_size_refuses_absurd_sizes(bad):
    with pytest.raises(ValueError, match=r"over the maximum of 2\^60 bytes"):
        parse_size(bad)
    assert parse_size(2**60) == 2**60


@pytest.mark.parametrize(
    ("section", "dotted"),
    [
        ({"tiers": {"cpu": {"capacity": "99999TiB"}}}, "tiers.cpu.capacity: 99999.0 TiB holds 419426205696 blocks"),
        ({"tiers": {"cpu": {"capacity": 1e30}}}, "tiers.cpu.capacity: size 1e+30"),
        ({"tiers": {"cpu": {"capacity": "10^30"}}}, "tiers.cpu.capacity: cannot parse size '10^30'"),
        ({"gpu": {"num_blocks": 10**22}}, "gpu.num_blocks: Input should be less than or equal to 2147483648"),
        ({"gpu": {"num_blocks": "1e22"}}, "gpu.num_blocks: Input should be a valid integer"),
        ({"gpu": {"device": "banana"}}, "gpu.device: 'banana' is not a device"),
        ({"gpu": {"device": "cuda:x"}}, "gpu.device"),
        ({"transfer": {"max_inflight_bytes": 0}}, "transfer.max_inflight_bytes: 0 bytes is smaller than one block"),
        ({"transfer": {"max_inflight_bytes": "100KiB"}}, "transfer.max_inflight_bytes: 102400 bytes"),
        ({"model": {"num_layers": 10**20, "num_kv_heads": 8, "head_dim": 128}}, "model.num_layers"),
        ({"model": {"num_layers": 4096, "num_kv_heads": 65536, "head_dim": 65536, "block_tokens": 1 << 20}},
         "model: one block would be 73786976294838206464 bytes, over the maximum of 2^60 bytes"),
        ({"replay": {"block_bytes": 1}}, "replay.block_bytes: 1 bytes is below the minimum of 512 bytes"),
        ({"replay": {"speed": float("nan")}}, "replay.speed"),
        ({"replay": {"speed": float("inf")}}, "replay.speed"),
        ({"replay": {"seed": 2**64}}, "replay.seed"),
        ({"replay": {"num_requests": 10**9}}, "replay.num_requests"),
    ],
)
def test_absurd_values_name_the_key(section, dotted):
    with pytest.raises(tkv.ConfigError) as info:
        tkv.load_config(section)
    assert dotted in str(info.value)


def test_in_flight_budget_of_exactly_one_block_is_fine():
    cfg = tkv.load_config({"model": {"bytes_per_block": 4096}, "transfer": {"max_inflight_bytes": 4096}})
    assert cfg.transfer.max_inflight_bytes == cfg.bytes_per_block
    for device in ("auto", "cpu", "cuda", "cuda:0", "cuda:12"):
        assert tkv.load_config({"gpu": {"device": device}}).gpu.device == device


def _disk(path, **extra) -> dict:
    return {"model": {"model_id": "m", "bytes_per_block": 4096}, "tiers": {"disk": {"enabled": True, "path": path, **extra}}}


@pytest.mark.parametrize(
    ("path", "fault"),
    [
        ("/tmp/tkv\0cache", "contains a NUL byte"),
        ("/tmp/" + "c" * 256, "has a component of 256 bytes, over NAME_MAX (255)"),
        ("/tmp/" + "/".join(["d" * 99] * 42), "bytes long, over PATH_MAX (4095)"),
        ("$TKV_TEST_UNSET/cache", "names an unset environment variable"),
        ("${TKV_TEST_UNSET}/cache", "names an unset environment variable"),
    ],
)
def test_disk_paths_the_os_cannot_take(monkeypatch, path, fault):
    monkeypatch.delenv("TKV_TEST_UNSET", raising=False)
    with pytest.raises(tkv.ConfigError, match=r"tiers\.disk\.path: ") as info:
        tkv.load_config(_disk(path))
    assert fault in str(info.value)
    assert "\n" not in str(info.value)


def test_disk_path_expands_home_and_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("TKV_TEST_DIR", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tkv.load_config(_disk("$TKV_TEST_DIR/a")).tiers.disk.path == str(tmp_path / "a")
    assert tkv.load_config(_disk("${TKV_TEST_DIR}/b")).tiers.disk.path == str(tmp_path / "b")
    assert tkv.load_config(_disk("~/c")).tiers.disk.path == str(tmp_path / "home" / "c")
    assert not (tmp_path / "a").exists() and not list(tmp_path.glob("$*"))  # nothing created, no literal $


@pytest.mark.skipif(mem_available() is None, reason="no /proc/meminfo MemAvailable here")
def test_cpu_tier_beyond_memory_needs_allow_overcommit():
    data = {"model": MIB64, "tiers": {"cpu": {"capacity": "1024TiB"}}}
    with pytest.raises(tkv.ConfigError, match=r"tiers\.cpu\.capacity: 1024\.0 TiB .* MemAvailable") as info:
        tkv.load_config(data)
    assert str(2**50 + (2**50 // 2**26) * 256) in str(info.value)  # capacity + the index it needs, in bytes
    data["tiers"]["cpu"]["allow_overcommit"] = True
    assert tkv.load_config(data).tiers.cpu.capacity == 2**50


def test_the_window_policy_s_ghosts_count_against_memory(tmp_path, monkeypatch):
    """The window's ghosts (GHOST_BYTES_PER_SLOT per slot of CPU + disk: one policy over both) are part of the index."""
    disk = {"enabled": True, "path": str(tmp_path / "cache"), "capacity": "1GiB"}
    data = {"model": {"model_id": "m", "bytes_per_block": "16KiB"}, "tiers": {"cpu": {"capacity": "16MiB"}, "disk": disk}}
    index = (1024 + 65536) * 256
    monkeypatch.setattr(tkv.config, "mem_available", lambda: 16 * 2**20 + index + 65536 * 100)
    assert tkv.load_config(data).eviction.policy == "lru"
    data["eviction"] = {"policy": "window"}
    with pytest.raises(tkv.ConfigError, match=r"tiers\.cpu\.capacity: .* ghosts of eviction\.policy 'window'") as info:
        tkv.load_config(data)
    assert GHOST_BYTES_PER_SLOT > 100 and str(16 * 2**20 + index + (1024 + 65536) * GHOST_BYTES_PER_SLOT) in str(info.value)


def test_disk_tier_beyond_free_space_needs_allow_overcommit(tmp_path):
    disk = {"enabled": True, "path": str(tmp_path / "cache"), "capacity": "1024TiB"}
    data = {"model": {"model_id": "m", **MIB64}, "tiers": {"cpu": {"allow_overcommit": True}, "disk": disk}}
    with pytest.raises(tkv.ConfigError, match=r"tiers\.disk\.capacity: 1024\.0 TiB needs \d+ bytes on disk .* free at"):
        tkv.load_config(data)
    disk["allow_overcommit"] = True
    assert tkv.load_config(data).tiers.disk.capacity == 2**50
    # The default, small capacities of the shipped configs pass the check on any machine that runs them.
    assert tkv.load_config(ROOT / "configs" / "default.yaml").tiers.disk.allow_overcommit is False


def test_disk_tier_counts_its_own_namespaces_as_room(tmp_path):
    """On restart the tier's existing files are reused, so they count as room, not as used space."""
    ns = tmp_path / "ns-abc"
    ns.mkdir()
    (ns / "blocks.dat").write_bytes(b"\1" * (1 << 20))
    room = host_checks.disk_room(tmp_path)
    free = shutil.disk_usage(tmp_path).free
    assert room is not None and room - free >= (1 << 20) - (64 << 10)  # allow for concurrent writers nearby


@pytest.mark.parametrize(
    ("text", "fault"),
    [
        ("tiers:\n  cpu:\n    capacity: 1MiB\ntiers:\n  cpu: {}\n", "line 4, column 1: duplicate key 'tiers' (first given at line 1)"),
        ("tiers:\n  cpu:\n    capacity: 1GiB\n    pin_memory: off\n    capacity: 2GiB\n",
         "line 5, column 5: duplicate key 'capacity' (first given at line 3)"),
        ("model: {dtype: float16, dtype: bfloat16}\n", "duplicate key 'dtype'"),
        ("model:\n  model_id: " + "[" * 600 + "]" * 600 + "\n", "nested too deeply"),
        ("replay:\n  seed: " + "7" * 5000 + "\n", "line 2, column 9: integer of 5000 characters is too long"),
    ],
)
def test_yaml_faults_are_one_line_config_errors(tmp_path, text, fault):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(tkv.ConfigError) as info:
        tkv.load_config(path)
    assert fault in str(info.value) and "\n" not in str(info.value)


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("base: &b {capacity: 1MiB, pin_memory: off}\n")
    data = yaml.load(path.read_text() + "cpu:\n  <<: *b\n  capacity: 2MiB\n", Loader=config_module._StrictLoader)  # noqa: S506
    assert data["cpu"] == {"capacity": "2MiB", "pin_memory": False}


def test_nested_too_deeply_as_a_mapping():
    deep: dict = {}
    node = deep
    for _ in range(5000):
        node["tiers"] = {}
        node = node["tiers"]
    with pytest.raises(tkv.ConfigError):
        tkv.load_config({"model": deep})
