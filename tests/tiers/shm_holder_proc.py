"""A process that creates a shared CPU tier segment, fills it, says where it is, then waits to be killed."""

import sys

from tiered_kv.tiers.shared_cpu import SharedSegment

if __name__ == "__main__":
    directory, name = sys.argv[1], sys.argv[2]
    seg = SharedSegment.create(directory, name, world_size=2, shard_bytes=4096, num_slots=8)
    seg.rows[:] = 0xAB
    print(seg.info.path, flush=True)
    sys.stdin.read()  # until killed (or stdin closes)
