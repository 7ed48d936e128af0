"""The remote tier's pieces that need no server: value format, residency filter, config, URL redaction."""

from __future__ import annotations

import numpy as np
import pytest
from redis_helpers import key_rows

import tiered_kv as tkv
from tiered_kv.errors import ConfigError, KeyFormatError
from tiered_kv.formats import remote_namespace
from tiered_kv.tiers.remote import RemoteResidency, redact
from tiered_kv.tiers.remote.format import (
    HDTYPE,
    HEADER_SIZE,
    check_values,
    encode_headers,
    namespace_digest,
    redis_keys,
    row_sums,
)

PLEN = 4096
NSD = namespace_digest("ns-a")


def values_for(keys: np.ndarray, payloads: list[bytes], nsd: bytes = NSD) -> list[bytes]:
    heads = encode_headers(keys, nsd, PLEN, row_sums(payloads))
    return [heads[i].tobytes() + payloads[i] for i in range(len(keys))]


def test_header_layout_and_round_trip():
    assert HDTYPE.itemsize == HEADER_SIZE == 80
    keys = key_rows("fmt", 4)
    payloads = [bytes([i]) * PLEN for i in range(4)]
    assert check_values(values_for(keys, payloads), keys, NSD, PLEN).all()
    k16 = key_rows("fmt16", 3, kb=16)
    assert check_values(values_for(k16, payloads[:3]), k16, NSD, PLEN).all()


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "extend", "garbage", "other_key",
                                    "other_namespace", "version", "empty", "not_bytes"])
def test_every_damage_is_a_miss_and_only_that_value(damage):
    keys = key_rows("dmg", 3)
    payloads = [np.random.default_rng(i).bytes(PLEN) for i in range(3)]
    vals = values_for(keys, payloads)
    v = bytearray(vals[1])
    if damage == "flip_payload":
        v[HEADER_SIZE + 1000] ^= 0x01
    elif damage == "flip_header":
        v[10] ^= 0x80
    elif damage == "truncate":
        v = v[:-1]
    elif damage == "extend":
        v += b"\0"
    elif damage == "garbage":
        v = bytearray(np.random.default_rng(9).bytes(len(v)))
    elif damage == "other_key":  # a whole valid value of key 0 stored under key 1
        v = bytearray(vals[0])
    elif damage == "other_namespace":
        v = bytearray(values_for(keys, payloads, namespace_digest("ns-b"))[1])
    elif damage == "version":  # a future format version, header checksum recomputed so only the version differs
        h = np.frombuffer(bytes(v[:HEADER_SIZE]), HDTYPE).copy()
        h["version"] = 2
        rows = h.view(np.uint8).reshape(1, HEADER_SIZE)
        h["xxh"] = row_sums([memoryview(rows[0])[: HEADER_SIZE - 8]])
        v[:HEADER_SIZE] = rows.tobytes()
    elif damage == "empty":
        v = bytearray()
    vals[1] = 12345 if damage == "not_bytes" else bytes(v)
    assert check_values(vals, keys, NSD, PLEN).tolist() == [True, False, True]


def test_keys_are_prefix_namespace_hex_and_namespaces_differ():
    keys = key_rows("rk", 2)
    rk = redis_keys(b"tkv:ns-x:", keys)
    assert rk[0] == b"tkv:ns-x:" + keys[0].tobytes().hex().encode()
    base = ("m", "", "float16", "d1", 4096, 32, "tp0of1")
    names = {remote_namespace(*base), remote_namespace("m2", *base[1:]), remote_namespace(*base[:3], "d2", *base[4:]),
             remote_namespace(*base[:6], "tp1of2"), remote_namespace(*base, tenant_salt="t")}
    assert len(names) == 5 and all(n.startswith("ns-") and len(n) == 27 for n in names)


def test_residency_known_add_discard():
    r = RemoteResidency(100)
    keys = key_rows("res", 10)
    assert not r.known(keys).any()
    r.add(keys[:5])
    r.add(keys[3:7])  # overlap: no duplicates
    assert r.known(keys).tolist() == [True] * 7 + [False] * 3 and len(r) == 7
    r.discard(keys[[0, 6, 9]])
    assert r.known(keys).tolist() == [False, True, True, True, True, True, False, False, False, False]
    with pytest.raises(KeyFormatError):
        r.known(key_rows("res", 2, kb=16))


def test_residency_is_bounded_and_evicts_oldest():
    r = RemoteResidency(8)
    keys = key_rows("ring", 20)
    r.add(keys[:6])
    r.add(keys[6:10])  # 10 keys into 8: the two oldest go
    assert len(r) == 8
    assert r.known(keys[:10]).tolist() == [False, False] + [True] * 8
    r.add(keys[10:20])  # a batch larger than the filter keeps its last 8
    assert r.known(keys).tolist() == [False] * 12 + [True] * 8
    r.discard(keys[12:14])
    r.add(keys[:1])
    assert len(r) == 7 and r.known(keys[:1]).all()


def test_residency_memory_per_key_is_small():
    r = RemoteResidency(100_000)
    r.add(key_rows("mem", 1000))
    assert r.nbytes / 100_000 < 60  # key bytes + index, no Python object per key


def _remote(**kw) -> dict:
    return {"tiers": {"remote": {"enabled": True, **kw}}}


def test_config_defaults_off_and_valid():
    assert tkv.load_config({}).tiers.remote.enabled is False
    c = tkv.load_config(_remote(url="unix:///run/redis.sock", ttl=60, timeout=2, password_env="REDIS_PW"))
    assert (c.tiers.remote.ttl, c.tiers.remote.timeout, c.tiers.remote.write) == (60, 2.0, "write_through")
    c = tkv.load_config(_remote(url="rediss://cache.example:6380/0", cluster=True, nodes=["10.0.0.1:7000", "h:7001"]))
    assert c.tiers.remote.cluster


@pytest.mark.parametrize(("remote", "needle"), [
    ({"url": "redis://user:hunter2@h:6379/0"}, "password_env"),
    ({"url": "redis://:hunter2@h:6379/0"}, "password_env"),
    ({"password": "hunter2"}, "password_env"),
    ({"url": "http://h:1"}, "scheme"),
    ({"url": "redis://h:70000"}, "does not parse"),
    ({"url": "unix://relative.sock"}, "absolute"),
    ({"url": "redis://h:1/x"}, "database"),
    ({"nodes": ["h:1"]}, "cluster: true"),
    ({"cluster": True, "nodes": ["h"]}, "host:port"),
    ({"cluster": True, "url": "redis://h:1/3"}, "database 0"),
    ({"cluster": True, "url": "unix:///s.sock"}, "TCP"),
    ({"password_env": "not a name"}, "environment variable"),
    ({"key_prefix": "a b"}, "whitespace"),
    ({"ttl": -1}, "ttl"),
    ({"timeout": 0}, "timeout"),
    ({"max_concurrency": 0}, "max_concurrency"),
    ({"capacity": "1KiB"}, "smaller than one block"),
    ({"write": "sometimes"}, "write"),
])
def test_config_errors_name_the_key_and_never_the_password(remote, needle):
    with pytest.raises(ConfigError) as err:
        tkv.load_config(_remote(**remote))
    assert needle in str(err.value) and "tiers.remote" in str(err.value)
    assert "hunter2" not in str(err.value)


def test_redact():
    assert redact("redis://u:secret@h:1/0") == "redis://u:***@h:1/0"
    assert redact("redis://h:1/0") == "redis://h:1/0"
