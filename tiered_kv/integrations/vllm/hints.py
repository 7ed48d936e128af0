"""Per-request cache hints from vLLM's ``kv_transfer_params``: ``{"tiered_kv": {...}}``.

``session`` (str or int) names the conversation the request belongs to; ``expect_followup``
(bool) protects its blocks until the next turn; ``end_session`` (bool) releases the session
when the request finishes (its blocks become the first to evict). They reach the cache's
``touch`` / ``store`` / ``release`` exactly as an embedding frontend passes them. A malformed
hint is logged and ignored: a hint never fails a request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestHints:
    session: str | int | None = None
    expect_followup: bool = False
    end_session: bool = False


NO_HINTS = RequestHints()


def hints_of(request: Any) -> RequestHints:
    params = getattr(request, "kv_transfer_params", None) or {}
    raw = params.get("tiered_kv") if isinstance(params, dict) else None
    if raw is None:
        return NO_HINTS
    if not isinstance(raw, dict):
        log.warning("tiered_kv: kv_transfer_params.tiered_kv must be a mapping, got %r; ignored", raw)
        return NO_HINTS
    session = raw.get("session")
    if session is not None and (isinstance(session, bool) or not isinstance(session, (str, int))):
        log.warning("tiered_kv: kv_transfer_params.tiered_kv.session must be a str or int, got %r; ignored", session)
        return NO_HINTS
    flags = {k: raw.get(k, False) for k in ("expect_followup", "end_session")}
    if not all(isinstance(v, bool) for v in flags.values()):
        log.warning("tiered_kv: kv_transfer_params.tiered_kv expect_followup/end_session must be booleans, got %r; "
                    "ignored", flags)  # fmt: skip
        return NO_HINTS
    if session is None and any(flags.values()):
        log.warning("tiered_kv: kv_transfer_params.tiered_kv: expect_followup/end_session need a session; ignored")
        return NO_HINTS
    return RequestHints(session, flags["expect_followup"], flags["end_session"])
