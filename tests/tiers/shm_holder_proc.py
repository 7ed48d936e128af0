"""A process that opens a shared CPU tier segment as its scheduler, fills it, says where it is, then waits.

usage: shm_holder_proc.py DIR NAME [unlink]: with ``unlink`` it removes the segment's name first (as the
scheduler does once every rank has mapped it)."""

import sys

from tiered_kv.tiers.shared_cpu import SegmentInfo, SharedSegment

if __name__ == "__main__":
    directory, name = sys.argv[1], sys.argv[2]
    info = SegmentInfo.for_engine(directory, name, world_size=2, shard_bytes=4096, num_slots=8)
    seg = SharedSegment.open(info, scheduler=True)
    seg.blocks[:] = 0xAB
    if sys.argv[3:] == ["unlink"]:
        seg.unlink_name()
    print(seg.info.path, flush=True)
    sys.stdin.read()  # until killed (or stdin closes)
