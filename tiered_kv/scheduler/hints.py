"""Per-request cache hints from vLLM's ``kv_transfer_params``: ``{"tiered_kv": {...}}``.

``session`` (str or int) names the conversation the request belongs to; ``expect_followup``
(bool) protects its blocks until the next turn; ``end_session`` (bool) releases the session
when the request finishes (its blocks become the first to evict). They reach the cache's
``touch`` / ``store`` / ``release`` exactly as an embedding frontend passes them. A malformed
hint is logged, counted (``malformed_hints``) and ignored, and so is an unknown field
(``unknown_hint_fields``): a hint never fails a request.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestHints:
    session: str | int | None = None
    expect_followup: bool = False
    end_session: bool = False


NO_HINTS = RequestHints()


FIELDS = ("session", "expect_followup", "end_session")


def hints_of(request: Any, counters: Counter[str] | None = None) -> RequestHints:
    """The request's hints; ``counters`` counts ``malformed_hints`` (ignored whole) and
    ``unknown_hint_fields`` (fields other than FIELDS: ignored, the rest still applies)."""
    params = getattr(request, "kv_transfer_params", None) or {}
    raw = params.get("tiered_kv") if isinstance(params, dict) else None
    if raw is None:
        return NO_HINTS
    hints = _parse(raw)
    if counters is not None:
        if hints is None:
            counters["malformed_hints"] += 1
        elif isinstance(raw, dict):
            unknown = sum(1 for k in raw if k not in FIELDS)
            if unknown:
                log.warning("tiered_kv: kv_transfer_params.tiered_kv: unknown fields %r ignored",
                            sorted(str(k) for k in raw if k not in FIELDS))  # fmt: skip
                counters["unknown_hint_fields"] += unknown
    return NO_HINTS if hints is None else hints


def _parse(raw: Any) -> RequestHints | None:
    """None for a malformed hint (logged)."""
    if not isinstance(raw, dict):
        log.warning("tiered_kv: kv_transfer_params.tiered_kv must be a mapping, got %r; ignored", raw)
        return None
    session = raw.get("session")
    if session is not None and (isinstance(session, bool) or not isinstance(session, (str, int))):
        log.warning("tiered_kv: kv_transfer_params.tiered_kv.session must be a str or int, got %r; ignored", session)
        return None
    flags = {k: raw.get(k, False) for k in ("expect_followup", "end_session")}
    if not all(isinstance(v, bool) for v in flags.values()):
        log.warning("tiered_kv: kv_transfer_params.tiered_kv expect_followup/end_session must be booleans, got %r; "
                    "ignored", flags)  # fmt: skip
        return None
    if session is None and any(flags.values()):
        log.warning("tiered_kv: kv_transfer_params.tiered_kv: expect_followup/end_session need a session; ignored")
        return None
    return RequestHints(session, flags["expect_followup"], flags["end_session"])
