"""On-disk format of the disk tier: record encoding, safe file primitives, block record I/O.

No event loop here: DiskStore runs all of this on its executor. A namespace directory
``root/ns-<20 hex>/`` holds:

* ``namespace.json`` -- the DiskNamespace fields plus the format version. The directory name is a hash
  of exactly that content, so user strings (model ids) never become path components, and a changed
  layout or format version gets a fresh directory instead of misreading an old one.
* ``blocks.dat`` -- ``num_slots`` fixed-size records (sparse file); record ``i`` starts at
  ``i * record_size``, ``record_size = align_up(128 + bytes_per_block, 4096)`` so every record is 4 KiB
  aligned (O_DIRECT works; records never share a page). A record is a 128-byte header (magic, version,
  key, slot, payload length, seq, xxh3-64 of the payload, xxh3-64 of the header) then the payload. The
  header goes out in the same ``pwritev`` as the payload, so a torn write reads back as a checksum or
  key mismatch, never as data.
* ``journal.tkv`` -- a 64-byte file header, then 64-byte records (commit: slot, seq, key, payload
  checksum; invalidate: slot), each with its own xxh3-64. Recovery keeps the last valid record per slot;
  torn tails and garbage fail their checksum and are skipped. The journal is only an index: every read
  re-verifies the block header, so a stale entry can cost a miss but never serve wrong bytes.
* ``lock`` -- flock'ed while a DiskStore has the directory open (one owner at a time).
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import stat
import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import xxhash

from tiered_kv.errors import ConfigError, DiskError

NS_FILE, DATA_FILE, JOURNAL_FILE, LOCK_FILE = "namespace.json", "blocks.dat", "journal.tkv", "lock"
FORMAT_NAME = "tiered_kv.disk"
FORMAT_VERSION = 1
ALIGN = 4096

# ---- block record header -------------------------------------------------------------------------
BLOCK_MAGIC = b"TKVB"
HEADER_SIZE = 128
# magic, version, key_len, flags, slot, reserved, payload_len, seq, payload_xxh, key; then zero pad.
_HDR = struct.Struct("<4sHBBIIQQQ32s48x")
_U64 = struct.Struct("<Q")

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

_xxh = xxhash.xxh3_64_intdigest


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class DiskNamespace:
    """What a disk directory's blocks mean: blocks from another model, dtype or layout never mix."""

    model_id: str
    dtype: str
    layout_digest: str
    bytes_per_block: int
    key_bytes: int  # 32 (sha256) or 16 (xxh3-128)
    revision: str = ""  # the model revision (weights change -> another namespace)
    shard: str = ""  # the engine's shard, e.g. "tp1of2": ranks never read each other's shards

    def __post_init__(self) -> None:
        for name in ("model_id", "dtype", "layout_digest"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(f"DiskNamespace.{name} must be a non-empty string, got {getattr(self, name)!r}")
        if not isinstance(self.bytes_per_block, int) or self.bytes_per_block <= 0:
            raise ConfigError(f"DiskNamespace.bytes_per_block must be a positive int, got {self.bytes_per_block!r}")
        if self.key_bytes not in (16, 32):
            raise ConfigError(f"DiskNamespace.key_bytes must be 16 or 32, got {self.key_bytes!r}")

    def canonical(self) -> dict:
        return {**asdict(self), "format": FORMAT_NAME, "format_version": FORMAT_VERSION}

    def dirname(self) -> str:
        blob = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":")).encode()
        return "ns-" + hashlib.sha256(blob).hexdigest()[:20]

    @property
    def record_size(self) -> int:
        return align_up(HEADER_SIZE + self.bytes_per_block)


def namespace_json(ns: DiskNamespace, created_unix: float) -> bytes:
    doc = {**ns.canonical(), "record_size": ns.record_size, "created_unix": round(created_unix, 3)}
    return (json.dumps(doc, sort_keys=True, indent=1) + "\n").encode()


def parse_namespace_json(raw: bytes) -> tuple[DiskNamespace, dict]:
    """Namespace and the whole document; ValueError if it is not one of ours."""
    doc = json.loads(raw)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise ValueError("not a tiered_kv disk namespace.json")
    if doc.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"format_version {doc.get('format_version')!r}, this build reads {FORMAT_VERSION}")
    try:
        ns = DiskNamespace(doc["model_id"], doc["dtype"], doc["layout_digest"], doc["bytes_per_block"],
                           doc["key_bytes"], doc.get("revision", ""), doc.get("shard", ""))
    except (KeyError, ConfigError) as e:
        raise ValueError(f"bad namespace.json: {e}") from e
    return ns, doc


# ---- block header ------------------------------------------------------------------------------
def encode_header(slot: int, key: bytes, payload_len: int, seq: int, payload_xxh: int) -> bytes:
    body = _HDR.pack(BLOCK_MAGIC, FORMAT_VERSION, len(key), 0, slot, 0, payload_len, seq, payload_xxh, key)
    return body + _U64.pack(_xxh(body))


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


def encode_journal(key_bytes: int, slots: np.ndarray, seqs: np.ndarray, psums: np.ndarray,
                   keys: np.ndarray) -> bytes:
    """A compacted journal: the header plus one commit per live slot (keys: uint8 [n, key_bytes])."""
    n = len(slots)
    rec = np.zeros(n, dtype=JDTYPE)
    rec["kind"] = JCOMMIT
    rec["key_len"] = key_bytes
    rec["slot"] = slots
    rec["seq"] = seqs
    rec["psum"] = psums
    kview = rec.view(np.uint8).reshape(n, JREC_SIZE)
    kview[:, 24 : 24 + key_bytes] = keys
    raw = memoryview(kview).cast("B") if n else memoryview(b"")
    rec["xxh"] = np.fromiter((_xxh(raw[i : i + 56]) for i in range(0, n * JREC_SIZE, JREC_SIZE)),
                             dtype=np.uint64, count=n)
    return journal_header(key_bytes) + rec.tobytes()


@dataclass
class JournalScan:
    """Last valid record per slot, live commits sorted oldest -> newest by seq."""

    header_ok: bool
    records: int  # whole records after the header
    bad: int  # records failing checksum / sanity
    torn_bytes: int  # partial record at the tail
    max_seq: int
    slots: np.ndarray  # uint32, commits only
    seqs: np.ndarray
    psums: np.ndarray
    keys: np.ndarray  # uint8 [n, key_bytes]


def scan_journal(raw: bytes | bytearray | memoryview, key_bytes: int) -> JournalScan:
    mv = memoryview(raw).cast("B")
    header_ok = len(mv) >= JREC_SIZE and bytes(mv[:JREC_SIZE]) == journal_header(key_bytes)
    body = mv[JREC_SIZE:] if header_ok else mv[:0]
    n = len(body) // JREC_SIZE
    torn = len(body) - n * JREC_SIZE
    arr = np.frombuffer(body, dtype=JDTYPE, count=n)
    sums = np.fromiter((_xxh(body[i : i + 56]) for i in range(0, n * JREC_SIZE, JREC_SIZE)),
                       dtype=np.uint64, count=n)
    kind = arr["kind"]
    ok = (sums == arr["xxh"]) & (
        ((kind == JCOMMIT) & (arr["key_len"] == key_bytes)) | (kind == JINVALIDATE))
    v = arr[ok]
    max_seq = int(v["seq"].max()) if len(v) else 0
    rev = v[::-1]  # journal order is per-slot write order; np.unique keeps the first hit = the last write
    _, idx = np.unique(rev["slot"], return_index=True)
    last = rev[idx]
    last = last[last["kind"] == JCOMMIT]
    last = last[np.argsort(last["seq"], kind="stable")]
    keys = last.view(np.uint8).reshape(len(last), JREC_SIZE)[:, 24 : 24 + key_bytes] if len(last) else \
        np.zeros((0, key_bytes), np.uint8)
    return JournalScan(header_ok, n, int(n - ok.sum()), torn, max_seq, last["slot"].astype(np.uint32),
                       last["seq"].astype(np.uint64), last["psum"].astype(np.uint64), np.ascontiguousarray(keys))


# ---- file primitives -----------------------------------------------------------------------------
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def open_private(path: str, *, trunc: bool = False) -> int:
    """Open (create) a regular file read-write, never through a symlink, mode 0600."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _CLOEXEC | (os.O_TRUNC if trunc else 0), 0o600)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise DiskError(errno.EINVAL, "not a regular file", path)
    if st.st_mode & 0o077:
        os.fchmod(fd, 0o600)
    return fd


def read_small(path: str, limit: int = 1 << 20, dir_fd: int | None = None) -> bytes:
    """Read a small regular file without following symlinks (namespace.json)."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            raise DiskError(errno.EINVAL, "not a small regular file", path)
        return os.pread(fd, st.st_size, 0)
    finally:
        os.close(fd)


def read_all(fd: int) -> memoryview:
    raw = memoryview(bytearray(os.fstat(fd).st_size))
    got = 0
    while got < len(raw) and (n := os.preadv(fd, [raw[got:]], got)) > 0:
        got += n
    return raw[:got]


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pwrite_all(fd: int, bufs: list, off: int, total: int) -> None:
    n = os.pwritev(fd, bufs, off)
    if n == total:
        return
    # Rare (a full disk, a signal): finish with plain pwrite so the real errno (ENOSPC...) surfaces.
    rest = b"".join(bytes(b) for b in bufs)[n:]
    while rest:
        k = os.pwrite(fd, rest, off + n)
        if k <= 0:
            raise OSError(errno.EIO, "pwrite made no progress")
        n, rest = n + k, rest[k:]


def replace_file(dirpath: str, name: str, data: bytes, *, fsync: bool) -> int:
    """Atomically replace dirpath/name with data (temp file + os.replace); returns the open fd."""
    path = os.path.join(dirpath, name)
    fd = open_private(path + ".tmp", trunc=True)
    try:
        pwrite_all(fd, [data], 0, len(data))
        if fsync:
            os.fsync(fd)
        os.replace(path + ".tmp", path)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(path + ".tmp")
        except OSError:
            pass
        raise
    if fsync:
        fsync_dir(dirpath)
    return fd


# ---- block records in the data file ------------------------------------------------------------
def payload_xxh(views: list[memoryview]) -> int:
    x = xxhash.xxh3_64()
    for v in views:
        x.update(v)
    return x.intdigest()


def write_record(fd: int, off: int, header: bytes, views: list[memoryview], bounce: memoryview | None) -> None:
    """ONE pwritev of header + payload: zero copy, or through a page-aligned bounce buffer for O_DIRECT."""
    if bounce is None:
        pwrite_all(fd, [header, *views], off, HEADER_SIZE + sum(len(v) for v in views))
        return
    bounce[:HEADER_SIZE], pos = header, HEADER_SIZE
    for v in views:
        bounce[pos : pos + len(v)] = v
        pos += len(v)
    pwrite_all(fd, [bounce], off, len(bounce))


def read_record(fd: int, off: int, slot: int, key: bytes, views: list[memoryview], bounce: memoryview | None) -> str:
    """Read a record into views and verify it: "" when it holds ``key`` intact, else why not."""
    want = HEADER_SIZE + sum(len(v) for v in views)
    if bounce is None:
        hdr = bytearray(HEADER_SIZE)
        if (n := os.preadv(fd, [hdr, *views], off)) != want:
            return f"short read ({n} of {want} bytes)"
    else:
        if (n := os.preadv(fd, [bounce], off)) < want:
            return f"short read ({n} of {want} bytes)"
        hdr, pos = bounce[:HEADER_SIZE], HEADER_SIZE
        for v in views:
            v[:] = bounce[pos : pos + len(v)]
            pos += len(v)
    psum, why = check_header(hdr, slot, key, want - HEADER_SIZE)
    if why:
        return why
    return "" if payload_xxh(views) == psum else "payload checksum mismatch"


def probe_o_direct(path: str, opener: Callable[[str], int]) -> tuple[int, str]:
    """(fd opened with O_DIRECT, "") when an aligned read works on ``path``, else (-1, why not)."""
    if not hasattr(os, "O_DIRECT"):
        return -1, "O_DIRECT is not available on this platform"
    try:
        fd = opener(path)
    except OSError as e:
        return -1, f"O_DIRECT open failed on {path}: {e}"
    try:
        if (n := os.preadv(fd, [mmap.mmap(-1, ALIGN)], 0)) != ALIGN:
            raise OSError(errno.EINVAL, f"aligned probe read returned {n} bytes")
    except OSError as e:
        os.close(fd)
        return -1, f"O_DIRECT probe read failed on {path}: {e}"
    return fd, ""
