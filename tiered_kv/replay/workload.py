"""A seeded, built-in multi-turn chat workload in the same Request form as a trace.

What it models, and why each part matters for a KV cache:

* Shared system prompts: a few prompts, picked with skewed popularity, head many
  conversations -- short, hot prefixes that any sane policy keeps.
* Growing conversations: turn k+1's input is turn k's input + the reply + a new
  user message, so every full block of turn k is a prefix of turn k+1.
* Skewed, interleaved revisits: each conversation draws a Pareto popularity
  weight; cold conversations come back after long gaps, which is what separates
  LRU from the offline optimum.
* One-off requests with unique prompts: pure misses that pollute the cache.
* Sessions, for frontend hints: every conversation has a session id, and the
  turn that closes it is marked ``last_turn``; a one-off is a session of its own
  and its only turn is its last. Conversations still open when the workload
  ends have no last turn (their future is unknown, as for a live frontend).

Block ids are chained like real prefix hashes: a block's id is interned from
(parent block id, the content pieces inside the block), so equal prefixes get
equal ids and a different prefix never reuses one. A partial last block therefore
changes id once the next turn fills it (as with real hashes, and as in the
Mooncake trace); all full blocks carry over.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from tiered_kv.errors import ConfigError
from tiered_kv.replay.trace import Request

__all__ = ["chat_workload"]

# A piece of a block: (segment id, start token, end token) inside that segment.
_Piece = tuple[int, int, int]


class _BlockHasher:
    """Interns (parent id, block content) -> sequential id: the chained prefix hash."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._ids: dict[tuple[int, tuple[_Piece, ...]], int] = {}

    def hash_ids(self, segments: list[tuple[int, int]]) -> tuple[int, ...]:
        """Block ids of a token sequence given as [(segment id, length), ...]."""
        ids: list[int] = []
        parent = -1
        pieces: list[_Piece] = []
        filled = 0
        for seg_id, length in segments:
            start = 0
            while start < length:
                take = min(length - start, self.block_tokens - filled)
                pieces.append((seg_id, start, start + take))
                start += take
                filled += take
                if filled == self.block_tokens:
                    parent = self._intern(parent, pieces)
                    ids.append(parent)
                    pieces, filled = [], 0
        if pieces:
            ids.append(self._intern(parent, pieces))
        return tuple(ids)

    def _intern(self, parent: int, pieces: list[_Piece]) -> int:
        key = (parent, tuple(pieces))
        block_id = self._ids.get(key)
        if block_id is None:
            block_id = self._ids[key] = len(self._ids)
        return block_id


@dataclass
class _Conversation:
    segments: list[tuple[int, int]]  # the context so far, as (segment id, tokens)
    weight: float  # popularity: chance of being the next one continued
    turns_left: int
    session: int
    tokens: int = 0


def _check_range(name: str, rng: tuple[int, int], lo: int = 0) -> None:
    if len(rng) != 2 or rng[0] < lo or rng[0] > rng[1]:
        raise ConfigError(f"{name} must be (min, max) with {lo} <= min <= max, got {rng!r}")


def _check_fraction(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"{name} must be within [0, 1], got {value!r}")


def chat_workload(
    num_requests: int = 3000,
    *,
    seed: int = 0,
    block_tokens: int = 512,
    num_system_prompts: int = 8,
    system_prompt_blocks: tuple[int, int] = (2, 12),
    one_off_fraction: float = 0.3,
    one_off_tokens: tuple[int, int] = (256, 16384),
    new_conversation_fraction: float = 0.25,
    turns: tuple[int, int] = (2, 12),
    user_tokens: tuple[int, int] = (40, 1500),
    document_fraction: float = 0.25,
    document_tokens: tuple[int, int] = (2000, 12000),
    reply_tokens: tuple[int, int] = (50, 700),
    max_context_tokens: int = 64 * 1024,
    popularity_alpha: float = 1.5,
    mean_interarrival_ms: float = 250.0,
) -> list[Request]:
    """Generate ``num_requests`` chat requests, deterministic for ``seed``.

    A request is a one-off (``one_off_fraction``), the first turn of a new
    conversation (``new_conversation_fraction`` of the rest, or whenever none is
    open), or the next turn of an open conversation picked by popularity. A user
    message is a pasted document with probability ``document_fraction``. A
    conversation closes after its drawn number of ``turns`` or once its context
    reaches ``max_context_tokens``. Defaults give, for 3000 requests, ~17k unique
    blocks and a 60-67 % unbounded block hit rate (seed-dependent). Raises ConfigError for invalid arguments.
    """
    if num_requests < 0:
        raise ConfigError(f"num_requests must be >= 0, got {num_requests}")
    if block_tokens < 1:
        raise ConfigError(f"block_tokens must be >= 1, got {block_tokens}")
    if num_system_prompts < 1:
        raise ConfigError(f"num_system_prompts must be >= 1, got {num_system_prompts}")
    _check_range("system_prompt_blocks", system_prompt_blocks)
    _check_range("turns", turns, lo=1)
    _check_range("user_tokens", user_tokens, lo=1)
    _check_range("document_tokens", document_tokens, lo=1)
    _check_range("one_off_tokens", one_off_tokens, lo=1)
    _check_range("reply_tokens", reply_tokens, lo=0)
    for name, value in (
        ("one_off_fraction", one_off_fraction),
        ("new_conversation_fraction", new_conversation_fraction),
        ("document_fraction", document_fraction),
    ):
        _check_fraction(name, value)
    if popularity_alpha <= 0 or mean_interarrival_ms <= 0:
        raise ConfigError("popularity_alpha and mean_interarrival_ms must be > 0")
    if max_context_tokens < 1:
        raise ConfigError(f"max_context_tokens must be >= 1, got {max_context_tokens}")

    rng = random.Random(seed)
    hasher = _BlockHasher(block_tokens)
    next_segment = 0

    def new_segment(tokens: int) -> tuple[int, int]:
        nonlocal next_segment
        next_segment += 1
        return (next_segment, tokens)

    def log_uniform(lo_hi: tuple[int, int]) -> int:
        # Message lengths are heavy-tailed: many short, a few long.
        lo, hi = lo_hi
        return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))

    def user_message() -> tuple[int, int]:
        if rng.random() < document_fraction:
            return new_segment(log_uniform(document_tokens))
        return new_segment(log_uniform(user_tokens))

    # System prompts: fixed segments, block-aligned, Zipf-popular (rank 1 hottest).
    system_prompts = [
        new_segment(block_tokens * rng.randint(*system_prompt_blocks)) for _ in range(num_system_prompts)
    ]
    system_weights = [1.0 / rank for rank in range(1, num_system_prompts + 1)]

    open_convs: list[_Conversation] = []
    requests: list[Request] = []
    sessions = 0  # ids in order of first appearance; drawn from no rng, so block ids do not change
    now = 0.0
    for _ in range(num_requests):
        now += rng.expovariate(1.0 / mean_interarrival_ms)
        kind = rng.random()
        if kind < one_off_fraction:
            segments = [new_segment(log_uniform(one_off_tokens))]  # a unique prompt: shares nothing
            reply = rng.randint(*reply_tokens)
            session, last_turn = sessions, True
            sessions += 1
        else:
            if not open_convs or rng.random() < new_conversation_fraction:
                (system,) = rng.choices(system_prompts, weights=system_weights)
                segs = [system] if system[1] else []
                conv = _Conversation(segs, rng.paretovariate(popularity_alpha), rng.randint(*turns), sessions)
                sessions += 1
                conv.tokens = sum(n for _, n in segs)
                open_convs.append(conv)
            else:
                (conv,) = rng.choices(open_convs, weights=[c.weight for c in open_convs])
            msg = user_message()
            conv.segments.append(msg)
            conv.tokens += msg[1]
            segments = list(conv.segments)
            reply = rng.randint(*reply_tokens)
            conv.turns_left -= 1
            # The reply joins the context of the next turn.
            conv.segments.append(new_segment(reply))
            conv.tokens += reply
            session, last_turn = conv.session, conv.turns_left <= 0 or conv.tokens >= max_context_tokens
            if last_turn:
                open_convs.remove(conv)
        input_length = sum(n for _, n in segments)
        requests.append(
            Request(
                timestamp_ms=round(now, 3),
                input_length=input_length,
                output_length=reply,
                hash_ids=hasher.hash_ids(segments),
                session=session,
                last_turn=last_turn,
            )
        )
    return requests
