"""KeyTable: fixed-length bytes key -> slot id, open addressing held in numpy arrays.

Nothing here is a Python object per key. The state is five arrays:

    slot_keys  uint8[num_slots, key_bytes]  the key each slot holds (rows of empty slots are stale)
    _pos       int32[num_slots]             entry (bucket * 16 + lane) holding the slot's key, -1 if none
    _tags      uint16[nb, 16]               16 hash bits of the key in each entry (0 where free)
    _slots     int32[nb, 16]                slot id in each entry, -1 where free
    _ovf       int32[nb]                    how many resident keys were placed past this bucket

Hash: ``m = ((first 8 key bytes, little-endian) ^ s1) * s2 mod 2**64`` with per-instance secrets from
os.urandom (s2 odd), never Python's hash(): callers can craft keys, but not against an unknown secret.
The bucket is the high 32 bits of ``m`` scaled to ``nb`` (multiply-shift, so ``nb`` need not be a
power of two and memory follows ``num_slots``); the tag is bits 16..31 of ``m``. Probing is linear
over buckets of 16 entries, 3 entries per slot: even keys inserted into a full table leave their home
bucket only about once in 10,000. Keys that share their first 8 bytes share bucket and tag: they
still work, through the exact probe, just slower.

Deletion uses neither tombstones nor backward shift: each bucket counts the resident keys that were
placed beyond it (an overflow count, as in Folly's F14). A search stops at the first bucket whose
count is 0, and ``remove`` decrements the counts along the removed key's path, so deletions leave
nothing behind, the table never degrades under churn, and no rebuild is ever needed.

Lookup is one vectorized pass: gather each key's home bucket, take the lane whose tag matches, and
verify every candidate's full key with one bytes comparison. Only keys that fail it (a displaced key,
a tag collision, a miss in an overflowed bucket) take the exact probe. One owner, one thread, no locks.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from tiered_kv.errors import KeyFormatError, TieredKVError

from .inputs import KeysIn, check_distinct_slots, key_buffer, slot_array

LANES = 16  # entries per bucket: one bucket's match mask is two uint64 words of 0/1 bytes
ENTRIES_PER_SLOT = 3  # ~5.3 keys per 16-lane bucket: ~1e-4 of keys inserted into a full table move on
# Lane of a match mask with one set byte, without a per-row reduction: fold the two mask words into
# one (lane 8+k becomes 0x10 in byte k), multiply so the top byte holds k+1 or 16*(k+1), look it up.
_FOLD = np.uint64(0x0102030405060708)
_LANE_LUT = np.zeros(256, dtype=np.uint64)
_LANE_LUT[np.arange(1, 9)] = np.arange(8)
_LANE_LUT[16 * np.arange(1, 9)] = np.arange(8, 16)
_U4, _U32, _U56 = np.uint64(4), np.uint64(32), np.uint64(56)



class _Lookup(NamedTuple):
    k0: np.ndarray  # uint64 first 8 bytes per key
    b: np.ndarray  # uint64 home bucket
    tag: np.ndarray  # uint16
    w: np.ndarray  # uint64[n, 2] lane match bytes of the home bucket
    cand: np.ndarray  # int32 candidate slot (-1: a free entry)
    got: np.ndarray  # the candidates' keys, one void item per key
    ok: bool  # every candidate verified: the key is at cand


class KeyTable:
    """Map fixed-length bytes keys to slot ids 0..num_slots-1; each slot holds at most one key."""

    def __init__(self, num_slots: int, key_bytes: int) -> None:
        for name, value, low in (("num_slots", num_slots, 1), ("key_bytes", key_bytes, 8)):  # hash reads 8
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise TieredKVError(f"KeyTable {name} must be an int >= {low}, got {value!r}")
        nb = -(-ENTRIES_PER_SLOT * int(num_slots) // LANES)
        if nb * LANES >= 2**31:
            raise TieredKVError(f"KeyTable num_slots={num_slots} needs {nb * LANES} entries, over int32")
        self.num_slots, self.key_bytes, self._nb = int(num_slots), int(key_bytes), nb
        seed = np.frombuffer(os.urandom(16), dtype="<u8")
        self._s1, self._s2 = np.uint64(seed[0]), np.uint64(seed[1] | np.uint64(1))
        self.slot_keys = np.zeros((self.num_slots, self.key_bytes), dtype=np.uint8)
        self._kv = self.slot_keys.view(f"V{self.key_bytes}").reshape(-1)  # one void item per slot
        self._k0 = np.ndarray((self.num_slots,), "<u8", self.slot_keys, strides=(self.key_bytes,))
        self._pos = np.full(self.num_slots, -1, dtype=np.int32)
        self._tags = np.zeros((nb, LANES), dtype=np.uint16)
        self._slots = np.full((nb, LANES), -1, dtype=np.int32)
        self._tags_flat, self._slots_flat = self._tags.reshape(-1), self._slots.reshape(-1)
        self._ovf = np.zeros(nb, dtype=np.int32)
        self._count = 0

    # -- public queries ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        """Bytes held by the table's arrays (views excluded)."""
        return sum(a.nbytes for a in (self.slot_keys, self._pos, self._tags, self._slots, self._ovf))

    def find(self, keys: KeysIn) -> np.ndarray:
        """int64 slot holding each key, -1 where absent."""
        joined, n = key_buffer(keys, self.key_bytes)
        return self._find(joined, n)

    def find_joined(self, joined: bytes | np.ndarray, n: int) -> np.ndarray:
        """Like ``find`` for ``n`` keys given back to back in one buffer of ``n * key_bytes`` bytes."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise KeyFormatError(f"key count must be an int >= 0, got {n!r}")
        if isinstance(joined, np.ndarray) and joined.dtype != np.uint8:
            raise KeyFormatError(f"joined keys must be bytes or a uint8 array, got {joined.dtype}")
        buf = joined.tobytes() if isinstance(joined, np.ndarray) else bytes(joined)
        if len(buf) != n * self.key_bytes:
            raise KeyFormatError(
                f"joined keys have {len(buf)} bytes, expected {n} keys * {self.key_bytes} = {n * self.key_bytes}"
            )
        return self._find(buf, int(n))

    def leading_run(self, keys: KeysIn) -> int:
        """Number of leading keys present; a lookup's hit prefix, in one vectorized pass.

        Validation costs O(1) Python work, not one len() per key (that alone would be half a dict
        loop): the keys' total length must be n * key_bytes, every counted key is verified byte for byte
        against the stored key at its offset, and the key that ends the run must be key_bytes long.
        So any single wrong-length key raises KeyFormatError; only wrong lengths that cancel out and
        re-cut into stored keys are read as the joined bytes cut every key_bytes. ``find`` checks each.
        """
        if not isinstance(keys, np.ndarray) and not hasattr(keys, "__getitem__"):
            keys = list(keys)
        joined, n = key_buffer(keys, self.key_bytes, each=False)
        if n == 0:
            return 0
        look = self._lookup(joined, n)
        if look.ok:  # the common full hit: every key verified by one comparison
            return n
        kb, bad, got, i = self.key_bytes, self._k0_differs(look), look.got, 0
        while i < n:  # the next key that fails: a miss ends the run, a displaced hit takes the probe
            j = i + int(bad[i:].argmax())
            j = j if bad[j] else n
            if got[i:j].tobytes() != joined[i * kb : j * kb]:  # equal first 8 bytes, different key
                j = i + int(np.flatnonzero(got[i:j] != np.frombuffer(joined, f"V{kb}", j - i, i * kb))[0])
            if j == n:
                return n
            if self._resolve(joined, look, j) < 0:
                if not isinstance(keys, np.ndarray) and len(keys[j]) != kb:  # the key that ends the run
                    raise KeyFormatError(f"keys[{j}] has {len(keys[j])} bytes, expected {kb}")
                return j
            i = j + 1
        return n

    def has_key(self, slots: np.ndarray) -> np.ndarray:
        """bool per slot: whether it holds a key."""
        return self._pos[slot_array(slots, self.num_slots, "has_key")] >= 0

    def key_of(self, slot: int) -> bytes:
        """The key a slot holds; TieredKVError if it holds none."""
        return self.keys_of(np.array([slot]))[0]

    def keys_of(self, slots: np.ndarray) -> list[bytes]:
        """The key each slot holds (for events and disk headers); TieredKVError if one holds none."""
        slots = self._require_held(slot_array(slots, self.num_slots, "keys_of"), "keys_of")
        raw, kb = self.slot_keys[slots].tobytes(), self.key_bytes
        return [raw[i : i + kb] for i in range(0, len(raw), kb)]

    def key_tags(self, slots: np.ndarray) -> np.ndarray:
        """uint64 keyed hash of each slot's whole key (a policy's ghost identity, as the core's: keys
        that share their first 8 bytes are different ghosts); stale for empty slots."""
        rows = self.slot_keys[slot_array(slots, self.num_slots, "key_tags")]
        pad = -self.key_bytes % 8
        words = np.pad(rows, ((0, 0), (0, pad))).view("<u8")  # [n, ceil(key_bytes / 8)]
        h = np.full(len(rows), self._s1, dtype=np.uint64)
        for w in words.T:
            h = (h ^ w) * self._s2
            h ^= h >> _U32
        return h

    # -- mutation ----------------------------------------------------------------------------------
    def insert(self, keys: KeysIn, slots: np.ndarray) -> None:
        """Store ``keys[i]`` in ``slots[i]``; keys must be absent and distinct, slots empty and distinct.

        Validation happens before any change, so a refused batch leaves the table as it was.
        """
        joined, n = key_buffer(keys, self.key_bytes)
        slots = slot_array(slots, self.num_slots, "insert")
        if slots.size != n:
            raise TieredKVError(f"insert got {n} keys but {slots.size} slots")
        if n == 0:
            return
        check_distinct_slots(slots, "insert")
        if self._pos[slots].max() >= 0:
            s = int(slots[np.argmax(self._pos[slots] >= 0)])
            raise TieredKVError(f"insert into slot {s}, which already holds key {self.key_of(s).hex()}")
        look = self._lookup(joined, n)
        # No tag match at home and no overflow past it proves every key absent without verifying.
        maybe = look.w.any() or self._ovf.take(look.b).any()
        found = self._found(joined, look) if maybe else look.cand
        if maybe and found.max() >= 0:
            i, kb = int(np.argmax(found >= 0)), self.key_bytes
            key, s, at = joined[i * kb : (i + 1) * kb].hex(), int(slots[i]), int(found[i])
            raise TieredKVError(f"insert of key {key} into slot {s}: the key is already in slot {at}")
        self._check_distinct_keys(joined, look.k0, slots)
        self.slot_keys[slots] = np.frombuffer(joined, dtype=np.uint8).reshape(n, self.key_bytes)
        self._place(look.b, look.tag, slots)
        self._count += n

    def remove(self, slots: np.ndarray) -> None:
        """Forget the keys held by these slots; each must hold one (else nothing changes)."""
        slots = slot_array(slots, self.num_slots, "remove")
        if slots.size == 0:
            return
        check_distinct_slots(slots, "remove")
        slots = self._require_held(slots, "remove")
        entry = self._pos[slots].astype(np.int64)
        home = self._bucket(self._mix(self._k0[slots])).view(np.int64)
        np.subtract.at(self._ovf, self._passed(home, entry), 1)  # undo the displaced keys' counts
        self._tags_flat[entry] = 0
        self._slots_flat[entry] = -1
        self._pos[slots] = -1
        self._count -= slots.size

    # -- checking ----------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise TieredKVError unless every stored key is findable at its slot and the counts add up."""
        occupied = np.flatnonzero(self._slots_flat >= 0)
        held = np.flatnonzero(self._pos >= 0)
        if not occupied.size == held.size == self._count:
            raise TieredKVError(
                f"KeyTable counts disagree: {occupied.size} entries, {held.size} slots held, len {self._count}"
            )
        if np.any(self._tags_flat[self._slots_flat < 0] != 0):
            raise TieredKVError("KeyTable has a free entry with a nonzero tag")
        slots = self._slots_flat[occupied].astype(np.int64)
        if np.any(self._pos[slots] != occupied):
            bad = int(slots[np.argmax(self._pos[slots] != occupied)])
            raise TieredKVError(f"KeyTable slot {bad}: its entry and its position disagree")
        m = self._mix(self._k0[slots])
        if np.any(self._tags_flat[occupied] != m.view(np.uint16)[1::4]):
            raise TieredKVError("KeyTable has an entry whose tag is not its key's")
        ovf = np.bincount(self._passed(self._bucket(m).view(np.int64), occupied), minlength=self._nb)
        if np.any(ovf != self._ovf):
            b = int(np.argmax(ovf != self._ovf))
            raise TieredKVError(f"KeyTable bucket {b}: overflow count {self._ovf[b]}, recomputed {ovf[b]}")
        got = self._find(self.slot_keys[slots].tobytes(), slots.size)
        if np.any(got != slots):
            bad = int(slots[np.argmax(got != slots)])
            raise TieredKVError(f"KeyTable slot {bad}: its key is not found at it")

    # -- internals ---------------------------------------------------------------------------------
    def _mix(self, k0: np.ndarray) -> np.ndarray:
        return (k0 ^ self._s1) * self._s2

    def _bucket(self, m: np.ndarray) -> np.ndarray:
        return ((m >> _U32) * np.uint64(self._nb)) >> _U32

    def _passed(self, home: np.ndarray, entry: np.ndarray) -> np.ndarray:
        """Buckets each key passed over between its home and its entry's bucket, all concatenated."""
        dist = (entry // LANES - home) % self._nb
        d, h = dist[dist > 0], home[dist > 0]
        ramp = np.arange(int(d.sum())) - np.repeat(np.cumsum(d) - d, d)
        return (np.repeat(h, d) + ramp) % self._nb

    def _lookup(self, joined: bytes, n: int) -> _Lookup:
        """One vectorized pass: home bucket, tag, and the slot in the lane whose tag matches."""
        k0 = np.ndarray((n,), "<u8", joined, strides=(self.key_bytes,))
        m = self._mix(k0)
        b = self._bucket(m)
        tag = m.view(np.uint16)[1::4]
        w = (self._tags.take(b, axis=0) == tag[:, None]).view(np.uint64)  # [n, 2]: lanes 0-7, 8-15
        lane = _LANE_LUT.take(((w[:, 0] | (w[:, 1] << _U4)) * _FOLD) >> _U56)
        # No match or several matches give some other entry of the bucket: verification catches it.
        cand = self._slots_flat.take((b << _U4) | lane)
        got = self._kv.take(cand)  # -1 wraps to the last row: every check below also tests cand < 0
        ok = got.tobytes() == joined and cand.min() >= 0
        return _Lookup(k0, b, tag, w, cand, got, ok)

    def _k0_differs(self, look: _Lookup) -> np.ndarray:
        """bool per key: certainly not verified (first 8 bytes differ, or no candidate)."""
        got_k0 = np.ndarray((look.cand.size,), "<u8", look.got.view(np.uint8), strides=(self.key_bytes,))
        return (got_k0 != look.k0) | (look.cand < 0)

    def _find(self, joined: bytes, n: int) -> np.ndarray:
        if n == 0:
            return np.empty(0, dtype=np.int64)
        return self._found(joined, self._lookup(joined, n))

    def _found(self, joined: bytes, look: _Lookup) -> np.ndarray:
        out = look.cand.astype(np.int64)
        if look.ok:
            return out
        bad = self._k0_differs(look)
        same = (~bad).nonzero()[0]  # equal first 8 bytes: compare the rest, row by row only if needed
        if same.size:
            want, got = np.frombuffer(joined, dtype=f"V{self.key_bytes}")[same], look.got[same]
            if got.tobytes() != want.tobytes():
                bad[same] = got != want
        rows = bad.nonzero()[0]
        out[rows] = -1
        w = look.w
        rows = rows[((w[rows, 0] | w[rows, 1]) != 0) | (self._ovf[look.b[rows]] != 0)]
        out[rows] = self._probe(joined, look.b, rows)
        return out

    def _resolve(self, joined: bytes, look: _Lookup, i: int) -> int:
        """Slot of key i, whose candidate failed: absent at once unless a tag matched in its home
        bucket or the bucket overflowed; only those few take the exact probe."""
        if not (look.w[i, 0] or look.w[i, 1] or self._ovf[look.b[i]]):
            return -1
        return int(self._probe(joined, look.b, np.array([i]))[0])

    def _probe(self, joined: bytes, home: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Slots of keys ``rows`` found anywhere in their home bucket's run: the exact path. Keys that
        share a home (crafted ones all do) are compared with the run's keys at once, in numpy."""
        out = np.full(rows.size, -1, dtype=np.int64)
        want = np.frombuffer(joined, dtype=self._kv.dtype)[rows]
        for b in set(home[rows].tolist()):
            mine = (home[rows] == b).nonzero()[0]
            slots = self._slots[self._run(b)].reshape(-1)
            slots = slots[slots >= 0]
            eq = self._kv[slots][None, :] == want[mine, None]  # keys are unique: at most one True per row
            hit = eq.any(axis=1)
            if hit.any():
                out[mine[hit]] = slots[eq[hit].argmax(axis=1)]
        return out

    def _run(self, b: int) -> np.ndarray:
        """Buckets a search from home ``b`` may visit: up to the first whose overflow count is 0."""
        width = 4
        while True:  # widen until the end is in view
            span = (b + np.arange(min(width, self._nb))) % self._nb
            ends = (self._ovf[span] == 0).nonzero()[0]
            if ends.size:
                return span[: ends[0] + 1]
            if width >= self._nb:
                return span
            width *= 4

    def _place(self, home: np.ndarray, tag: np.ndarray, slots: np.ndarray) -> None:
        """Write new entries in rounds. Keys aiming at one bucket take its free lanes in order (so one
        batch never puts two keys in one entry); the rest count themselves in that bucket's overflow
        and aim at the next bucket."""
        cur, todo = home.astype(np.int64), np.arange(slots.size)
        while todo.size:
            todo = todo[np.argsort(cur[todo], kind="stable")]
            cb = cur[todo]
            free = self._slots[cb] < 0
            first = np.ones(todo.size, dtype=bool)
            np.not_equal(cb[1:], cb[:-1], out=first[1:])
            if first.all():  # one key per bucket: its first free lane
                lane = free.argmax(axis=1)
                fits = free[np.arange(todo.size), lane]
            else:  # the r-th key aiming at a bucket takes its r-th free lane
                k = np.arange(todo.size)
                rank = k - np.maximum.accumulate(np.where(first, k, 0))
                fits = rank < free.sum(axis=1)
                lane = np.argmax(free & (np.cumsum(free, axis=1) == (rank + 1)[:, None]), axis=1)
            entry = cb[fits] * LANES + lane[fits]
            placed = todo[fits]
            self._tags_flat[entry] = tag[placed]
            self._slots_flat[entry] = slots[placed]
            self._pos[slots[placed]] = entry
            if fits.all():
                return
            np.add.at(self._ovf, cb[~fits], 1)
            todo = todo[~fits]
            cur[todo] = (cb[~fits] + 1) % self._nb

    def _require_held(self, slots: np.ndarray, op: str) -> np.ndarray:
        pos = self._pos[slots]
        if pos.size and pos.min() < 0:
            raise TieredKVError(f"{op}: slot {int(slots[np.argmax(pos < 0)])} holds no key")
        return slots

    def _check_distinct_keys(self, joined: bytes, k0: np.ndarray, slots: np.ndarray) -> None:
        k0 = np.sort(k0)
        if np.any(k0[1:] == k0[:-1]):  # equal first 8 bytes (rare): compare whole keys
            kb, seen = self.key_bytes, {}
            for i in range(k0.size):
                key = joined[i * kb : (i + 1) * kb]
                if seen.setdefault(key, i) != i:
                    raise TieredKVError(
                        f"insert of key {key.hex()} into slots {int(slots[seen[key]])} and {int(slots[i])} in one batch"
                    )
