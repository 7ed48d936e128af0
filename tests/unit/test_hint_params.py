"""Hints from vLLM's kv_transfer_params: parsed, and every malformed hint or unknown field counted."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from tiered_kv.scheduler.hints import NO_HINTS, RequestHints, hints_of


def req(raw):
    return SimpleNamespace(kv_transfer_params={"tiered_kv": raw})


def test_well_formed_hints_are_read_and_unknown_fields_are_counted_but_do_not_void_the_rest():
    c: Counter[str] = Counter()
    assert hints_of(req({"session": "s", "expect_followup": True}), c) == RequestHints("s", True, False)
    assert hints_of(req({"session": 3, "end_session": True, "sesion": "x", "priority": 9}), c) == RequestHints(3, False, True)
    assert c == Counter(unknown_hint_fields=2)
    assert hints_of(SimpleNamespace(kv_transfer_params=None), c) is NO_HINTS and c["malformed_hints"] == 0


def test_malformed_hints_are_ignored_whole_and_counted():
    c: Counter[str] = Counter()
    for raw in ("s", {"session": True}, {"session": 1.5}, {"session": "s", "expect_followup": "yes"},
                {"expect_followup": True}):  # fmt: skip
        assert hints_of(req(raw), c) is NO_HINTS, raw
    assert c == Counter(malformed_hints=5)
