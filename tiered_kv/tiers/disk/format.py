"""On-disk format of the disk tier: namespace.json, record and journal encoding, block record I/O.

No event loop and no I/O here (record I/O: records.py; file primitives: files.py). A namespace directory
``root/ns-<20 hex>/`` holds:

* ``namespace.json`` -- the DiskNamespace fields plus the format version. The directory name is a hash
  of exactly that content, so user strings (model ids) never become path components, and a changed
  layout or format version gets a fresh directory instead of misreading an old one.
* ``blocks.dat`` -- ``num_slots`` fixed-size records (sparse file); record ``i`` starts at
  ``i * record_size``, ``record_size = align_up(128 + bytes_per_block, 4096)`` so every record is 4 KiB
  aligned (O_DIRECT works; records never share a page). A record is a 128-byte header (magic, version,
  key, slot, payload length, seq, xxh3-64 of the payload, xxh3-64 of the header) then the payload, then
  zero padding. The header goes out in the same ``pwritev`` as the payload, so a torn write reads back as
  a checksum or key mismatch, never as data. Headers are built and checked a batch at a time as numpy
  structured rows (``HDTYPE``), byte for byte the ``_HDR`` struct.
* ``journal.tkv`` -- a 64-byte file header, then 64-byte records (commit: slot, seq, key, payload
  checksum; invalidate: slot), each with its own xxh3-64. Recovery (recovery.py) keeps the last
  valid record per slot; torn tails and garbage fail their checksum and are skipped. The journal is only an index: every read
  re-verifies the block header, so a stale entry can cost a miss but never serve wrong bytes.
* ``lock`` -- flock'ed while a DiskStore has the directory open (one owner at a time).
"""

from __future__ import annotations

import json
import struct

import numpy as np
import xxhash

from ...errors import ConfigError
from ...formats import DISK_FORMAT_NAME as FORMAT_NAME
from ...formats import DISK_FORMAT_VERSION as FORMAT_VERSION
from ...formats import DISK_HEADER_SIZE as HEADER_SIZE
from ...formats import DiskNamespace

NS_FILE, DATA_FILE, JOURNAL_FILE, LOCK_FILE = "namespace.json", "blocks.dat", "journal.tkv", "lock"

# ---- block record header -------------------------------------------------------------------------
BLOCK_MAGIC = b"TKVB"
# magic, version, key_len, flags, slot, reserved, payload_len, seq, payload_xxh, key; then zero pad.
_HDR = struct.Struct("<4sHBBIIQQQ32s48x")
_U64 = struct.Struct("<Q")
HDTYPE = np.dtype(  # the same 128 bytes as _HDR + its xxh3, for whole batches of headers
    [("magic", "S4"), ("version", "<u2"), ("key_len", "u1"), ("flags", "u1"), ("slot", "<u4"), ("_r", "<u4"),
     ("plen", "<u8"), ("seq", "<u8"), ("psum", "<u8"), ("key", "V32"), ("_pad", "V48"), ("xxh", "<u8")]
)
_HKEY = 40  # byte offset of the key inside a header

# ---- journal -------------------------------------------------------------------------------------
JOURNAL_MAGIC = b"TKVJ"
JREC_SIZE = 64
JCOMMIT = 1
JINVALIDATE = 2
_JHDR = struct.Struct("<4sHHB47x")  # magic, version, record size, key bytes; + xxh3 = 64 bytes
_JREC = struct.Struct("<BBHIQQ32s")  # kind, key_len, reserved, slot, seq, payload_xxh, key; + xxh3
JDTYPE = np.dtype(
    [("kind", "u1"), ("key_len", "u1"), ("_r", "<u2"), ("slot", "<u4"), ("seq", "<u8"),
     ("psum", "<u8"), ("key", "V32"), ("xxh", "<u8")]
)
_JKEY = 24  # byte offset of the key inside a journal record

_xxh = xxhash.xxh3_64_intdigest


def namespace_json(ns: DiskNamespace, created_unix: float) -> bytes:
    doc = {**ns.canonical(), "record_size": ns.record_size, "created_unix": round(created_unix, 3)}
    return (json.dumps(doc, sort_keys=True, indent=1) + "\n").encode()


class ForeignNamespace(ValueError):
    """Raised for a namespace.json of another program or another format version: not ours to touch."""


def parse_namespace_json(raw: bytes) -> tuple[DiskNamespace, dict]:
    """Namespace and the whole document. ForeignNamespace when it belongs to someone else (another format
    or format version); plain ValueError when it is damaged (not JSON, wrong shape, bad fields)."""
    try:
        doc = json.loads(raw)
    except RecursionError:
        raise ValueError("not JSON (nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"not JSON ({type(e).__name__})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"JSON {type(doc).__name__}, not an object")
    fmt = doc.get("format")
    if isinstance(fmt, str) and fmt != FORMAT_NAME:
        raise ForeignNamespace(f"format {fmt!r}, not {FORMAT_NAME!r}")
    if fmt is None:
        raise ValueError("no 'format' field")
    if fmt != FORMAT_NAME:
        raise ValueError(f"'format' is {type(fmt).__name__}, not a string")
    if doc.get("format_version") != FORMAT_VERSION:
        raise ForeignNamespace(f"format_version {doc.get('format_version')!r}, this build reads {FORMAT_VERSION}")
    try:
        extra = {k: doc.get(k, "") for k in ("revision", "shard")}
        if not all(isinstance(v, str) for v in extra.values()):
            raise ConfigError(f"revision/shard must be strings, got {extra!r}")
        ns = DiskNamespace(doc["model_id"], doc["dtype"], doc["layout_digest"], doc["bytes_per_block"],
                           doc["key_bytes"], **extra)
    except (KeyError, ConfigError) as e:
        raise ValueError(f"bad namespace.json: {type(e).__name__} {e}") from None
    return ns, doc


# ---- block header ------------------------------------------------------------------------------
def _row_sums(rows: np.ndarray, width: int) -> np.ndarray:
    """xxh3-64 of the first ``width`` bytes of each row of a C-contiguous uint8 [n, m] array."""
    n, m = rows.shape
    mv = memoryview(rows).cast("B") if n else memoryview(b"")
    return np.fromiter((_xxh(mv[i : i + width]) for i in range(0, n * m, m)), dtype=np.uint64, count=n)


def encode_headers(slots: np.ndarray, keys: np.ndarray, payload_len: int, seqs: np.ndarray,
                   psums: np.ndarray) -> np.ndarray:
    """Headers of a batch as uint8 [n, HEADER_SIZE] (keys: uint8 [n, key_bytes])."""
    n, kb = keys.shape
    h = np.zeros(n, HDTYPE)
    h["magic"], h["version"], h["key_len"] = BLOCK_MAGIC, FORMAT_VERSION, kb
    h["slot"], h["plen"], h["seq"], h["psum"] = slots, payload_len, seqs, psums
    rows = h.view(np.uint8).reshape(n, HEADER_SIZE)
    rows[:, _HKEY : _HKEY + kb] = keys
    h["xxh"] = _row_sums(rows, HEADER_SIZE - 8)
    return rows


def check_headers(rows: np.ndarray, slots: np.ndarray, keys: np.ndarray, payload_len: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(ok mask, payload xxh3 per header) for C-contiguous uint8 [n, HEADER_SIZE] headers read back.

    ok: the header is intact (its own checksum, magic, version) and describes this slot, this key and
    this payload length. ``check_header`` says why a single one is not.
    """
    n, kb = keys.shape
    h = rows.view(HDTYPE).reshape(n)
    ok = (_row_sums(rows, HEADER_SIZE - 8) == h["xxh"]) & (h["magic"] == BLOCK_MAGIC)
    ok &= (h["version"] == FORMAT_VERSION) & (h["slot"] == slots) & (h["plen"] == payload_len)
    ok &= (h["key_len"] == kb) & (rows[:, _HKEY : _HKEY + kb] == keys).all(axis=1)
    return ok, h["psum"]


def check_header(hdr: bytes | bytearray | memoryview, slot: int, key: bytes, payload_len: int) -> tuple[int, str]:
    """Return (payload_xxh, "") when the header is intact and describes (slot, key, payload_len), else (0, why)."""
    if len(hdr) < HEADER_SIZE:
        return 0, "short header"
    body = bytes(hdr[: HEADER_SIZE - 8])
    if _U64.unpack_from(hdr, HEADER_SIZE - 8)[0] != _xxh(body):
        return 0, "header checksum mismatch" if body[:4] == BLOCK_MAGIC else "no block header (bad magic)"
    magic, ver, klen, _f, hslot, _r, plen, _seq, psum, hkey = _HDR.unpack(body)
    if magic != BLOCK_MAGIC or ver != FORMAT_VERSION:
        return 0, f"bad magic/version {magic!r}/{ver}"
    if hslot != slot:
        return 0, f"record belongs to slot {hslot}"
    if plen != payload_len:
        return 0, f"payload length {plen} != {payload_len}"
    if hkey[:klen] != key or klen != len(key):
        return 0, "key mismatch (slot holds another block)"
    return psum, ""


# ---- journal -----------------------------------------------------------------------------------
def journal_header(key_bytes: int) -> bytes:
    body = _JHDR.pack(JOURNAL_MAGIC, FORMAT_VERSION, JREC_SIZE, key_bytes)
    return body + _U64.pack(_xxh(body))


def jrecord(kind: int, slot: int, seq: int, key: bytes = b"", psum: int = 0) -> bytes:
    body = _JREC.pack(kind, len(key), 0, slot, seq, psum, key)
    return body + _U64.pack(_xxh(body))


def encode_records(kind: int, slots: np.ndarray, seqs: np.ndarray | int, psums: np.ndarray | int = 0,
                   keys: np.ndarray | None = None) -> bytes:
    """Journal records of one kind for a batch (keys: uint8 [n, key_bytes], or None for invalidations)."""
    n = len(slots)
    rec = np.zeros(n, dtype=JDTYPE)
    rec["kind"], rec["slot"], rec["seq"], rec["psum"] = kind, slots, seqs, psums
    rows = rec.view(np.uint8).reshape(n, JREC_SIZE)
    if keys is not None:
        rec["key_len"] = keys.shape[1]
        rows[:, _JKEY : _JKEY + keys.shape[1]] = keys
    rec["xxh"] = _row_sums(rows, JREC_SIZE - 8)
    return rec.tobytes()


def encode_journal(key_bytes: int, slots: np.ndarray, seqs: np.ndarray, psums: np.ndarray,
                   keys: np.ndarray) -> bytes:
    """A compacted journal: the header plus one commit per live slot (keys: uint8 [n, key_bytes])."""
    return journal_header(key_bytes) + encode_records(JCOMMIT, slots, seqs, psums, keys.reshape(len(slots), key_bytes))
