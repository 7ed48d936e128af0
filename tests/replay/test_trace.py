"""Mooncake JSONL parsing: good files, every malformed kind, max_requests."""

from __future__ import annotations

import json

import pytest

from tiered_kv.errors import TieredKVError, TraceError
from tiered_kv.replay.trace import MAX_HASH_IDS, MAX_LINE_BYTES, Request, parse_trace_lines, read_trace

GOOD = [
    {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
    {"timestamp": 12.5, "input_length": 600, "output_length": 0, "hash_ids": [0, 2], "extra": "ignored"},
    {"timestamp": 40, "input_length": 0, "output_length": 3, "hash_ids": []},
]


def _write(tmp_path, lines: list[str], name: str = "trace.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_reads_good_file_with_blank_lines_and_extra_keys(tmp_path):
    lines = [json.dumps(GOOD[0]), "", "   ", json.dumps(GOOD[1]), json.dumps(GOOD[2])]
    reqs = read_trace(_write(tmp_path, lines))
    assert reqs == [
        Request(0.0, 1000, 5, (0, 1)),
        Request(12.5, 600, 0, (0, 2)),
        Request(40.0, 0, 3, ()),
    ]
    assert isinstance(reqs[0].hash_ids, tuple)
    assert isinstance(reqs[0].timestamp_ms, float)


def test_accepts_str_path_and_crlf(tmp_path):
    path = tmp_path / "crlf.jsonl"
    path.write_bytes(b"\r\n".join(json.dumps(o).encode() for o in GOOD) + b"\r\n")
    assert len(read_trace(str(path))) == 3


def test_request_is_frozen():
    req = Request(0.0, 1, 1, (1,))
    with pytest.raises(AttributeError):
        req.input_length = 2  # type: ignore[misc]


@pytest.mark.parametrize("limit, expected", [(None, 3), (0, 0), (1, 1), (2, 2), (10, 3)])
def test_max_requests(tmp_path, limit, expected):
    path = _write(tmp_path, [json.dumps(o) for o in GOOD])
    assert len(read_trace(path, max_requests=limit)) == expected


def test_max_requests_stops_before_a_later_bad_line(tmp_path):
    path = _write(tmp_path, [json.dumps(GOOD[0]), "not json"])
    assert len(read_trace(path, max_requests=1)) == 1
    with pytest.raises(TraceError):
        read_trace(path)


def test_negative_max_requests_rejected():
    with pytest.raises(TraceError, match="max_requests"):
        parse_trace_lines([], max_requests=-1)


_DROP = object()  # marks a field to delete


def _obj(**changes):
    obj = dict(GOOD[0])
    for key, value in changes.items():
        if value is _DROP:
            del obj[key]
        else:
            obj[key] = value
    return json.dumps(obj)


MALFORMED = {
    "invalid json": ("{not json", "invalid JSON"),
    "truncated json": ('{"timestamp": 0, "input_length": 1', "invalid JSON"),
    "array not object": ("[1, 2, 3]", "expected a JSON object"),
    "bare number": ("42", "expected a JSON object"),
    "missing timestamp": (_obj(timestamp=_DROP), "missing field 'timestamp'"),
    "missing input_length": (_obj(input_length=_DROP), "missing field 'input_length'"),
    "missing output_length": (_obj(output_length=_DROP), "missing field 'output_length'"),
    "missing hash_ids": (_obj(hash_ids=_DROP), "missing field 'hash_ids'"),
    "string timestamp": (_obj(timestamp="0"), "'timestamp'"),
    "bool timestamp": (_obj(timestamp=True), "'timestamp'"),
    "negative timestamp": (_obj(timestamp=-1), "'timestamp' must be >= 0"),
    "nan timestamp": ('{"timestamp": NaN, "input_length": 1, "output_length": 1, "hash_ids": [1]}', "finite"),
    "float input_length": (_obj(input_length=1.5), "'input_length' must be an integer"),
    "bool input_length": (_obj(input_length=True), "'input_length' must be an integer"),
    "negative input_length": (_obj(input_length=-3), "'input_length' must be >= 0"),
    "string output_length": (_obj(output_length="5"), "'output_length' must be an integer"),
    "negative output_length": (_obj(output_length=-1), "'output_length' must be >= 0"),
    "hash_ids not list": (_obj(hash_ids=7), "'hash_ids' must be a list"),
    "hash_ids object": (_obj(hash_ids={"a": 1}), "'hash_ids' must be a list"),
    "string hash id": (_obj(hash_ids=[1, "2"]), "hash_ids[1] must be an integer"),
    "bool hash id": (_obj(hash_ids=[False]), "hash_ids[0] must be an integer"),
    "float hash id": (_obj(hash_ids=[1, 2, 3.0]), "hash_ids[2] must be an integer"),
    "negative hash id": (_obj(hash_ids=[0, -1]), "hash_ids[1] must be >= 0"),
    # issue 9: each of these was a traceback (OverflowError, RecursionError, ValueError) or an absurd value
    "hash id 2^64": (_obj(hash_ids=[2**64 - 1, 2**64]), "hash_ids[1] must be < 2^64"),
    "timestamp 10^400 (int)": (_obj(timestamp=10**400), "'timestamp' must be <= 2^53 ms, got an integer of about 2^1328"),
    "timestamp 1e400 (inf)": ('{"timestamp": 1e400, "input_length": 1, "output_length": 1, "hash_ids": [1]}', "finite"),
    "timestamp over 2^53": (_obj(timestamp=2.0**60), "'timestamp' must be <= 2^53 ms"),
    "nested timestamp": (_obj(timestamp={"ms": [1, {"at": 2}]}), "'timestamp' must be a finite number, got a JSON object"),
    "nested hash id": (_obj(hash_ids=[1, [2, [3]]]), "hash_ids[1] must be an integer, got a JSON array"),
    "deep nesting": (_obj(hash_ids=[]).replace("[]", "[" * 5000 + "]" * 5000), "invalid JSON (nested too deeply)"),
    "5000-digit number": (_obj(input_length=0).replace('"input_length": 0', '"input_length": ' + "9" * 5000), "invalid JSON"),
    "input_length 2^64": (_obj(input_length=2**64), "'input_length' must be < 2^64"),
    "too many hash ids": (_obj(hash_ids=[1] * (MAX_HASH_IDS + 1)), f"hash_ids has {MAX_HASH_IDS + 1} ids, over the maximum"),
}


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_malformed_line_names_file_line_and_fault(tmp_path, kind):
    bad, fault = MALFORMED[kind]
    # Good line, blank line, good line, then the bad one: line 4 counts blanks.
    path = _write(tmp_path, [json.dumps(GOOD[0]), "", json.dumps(GOOD[1]), bad])
    with pytest.raises(TraceError) as info:
        read_trace(path)
    message = str(info.value)
    assert f"{path}:4" in message
    assert fault in message


def test_parse_lines_uses_source_name():
    with pytest.raises(TraceError, match=r"^mem:2: invalid JSON"):
        parse_trace_lines([json.dumps(GOOD[0]), "{"], source="mem")


def test_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(json.dumps(GOOD[0]).encode() + b"\n\xff\xfe\n")
    with pytest.raises(TraceError, match=rf"{path.name}:2: not UTF-8"):
        read_trace(path)


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope" / "trace.jsonl"
    with pytest.raises(TraceError, match="not found") as info:
        read_trace(missing)
    assert str(missing) in str(info.value)


def test_directory_is_rejected(tmp_path):
    with pytest.raises(TraceError, match="directory"):
        read_trace(tmp_path)


def test_trace_error_is_a_tiered_kv_value_error():
    with pytest.raises(TieredKVError):
        parse_trace_lines(["[]"])
    with pytest.raises(ValueError):
        parse_trace_lines(["[]"])


def test_unsigned_64_bit_hash_ids_are_legal(tmp_path):
    ids = [0, 2**63 - 1, 2**63, 2**64 - 1]
    path = _write(tmp_path, [_obj(hash_ids=ids)])
    assert read_trace(path)[0].hash_ids == tuple(ids)


def test_overlong_line_is_refused_unparsed_with_bounded_memory(tmp_path):
    """A 50 MB line (26 s and 1.2 GB before): refused by its length, never read whole."""
    import tracemalloc

    path = tmp_path / "long.jsonl"
    ids = ",".join(["123456789"] * 5_000_000)
    path.write_text(json.dumps(GOOD[0]) + f'\n{{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [{ids}]}}\n')
    tracemalloc.start()
    try:
        with pytest.raises(TraceError, match=rf"{path.name}:2: line longer than {MAX_LINE_BYTES} bytes"):
            read_trace(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * MAX_LINE_BYTES  # the line is 50 MB; at most one bounded read of it is held


def test_line_of_exactly_the_limit_is_parsed(tmp_path):
    head = json.dumps(GOOD[0])[:-1] + ', "pad": "'
    line = head + "x" * (MAX_LINE_BYTES - len(head) - 2) + '"}'
    assert len(line) == MAX_LINE_BYTES
    path = tmp_path / "edge.jsonl"
    path.write_text(line + "\n" + line + "\n")
    assert len(read_trace(path)) == 2
    with pytest.raises(TraceError, match="mem:1: line longer than"):
        parse_trace_lines([line + "x"], source="mem")
