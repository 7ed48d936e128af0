"""--capacity-share's split: a pure function of (unique blocks, longest request, share)."""

from __future__ import annotations

import itertools

import pytest

from tiered_kv.errors import ConfigError
from tiered_kv.replay.sizing import longest_request, split_capacity
from tiered_kv.replay.trace import Request

MOONCAKE_UNIQUE, MOONCAKE_LONGEST = 43_924, 374  # ../shared/data/README.md; longest measured


@pytest.mark.parametrize(
    ("share", "gpu", "cpu", "disk"),
    [
        (0.01, 374, 64, 1),  # 439 blocks: the GPU holds the longest request, the CPU gives way to one disk block
        (0.05, 374, 549, 1273),  # 2,196: still the longest request on the GPU
        (0.10, 439, 1098, 2855),  # 4,392: 10 % of the total now exceeds the longest request
        (0.25, 1098, 2745, 7138),  # 10,981
    ],
)
def test_mooncake_split(share, gpu, cpu, disk):
    s = split_capacity(MOONCAKE_UNIQUE, MOONCAKE_LONGEST, share)
    assert (s.gpu, s.cpu, s.disk) == (gpu, cpu, disk)
    assert s.total == round(share * MOONCAKE_UNIQUE)


def test_plain_split_is_ten_twenty_five_and_the_rest():
    s = split_capacity(10_000, 50, 0.1)
    assert (s.gpu, s.cpu, s.disk, s.total) == (100, 250, 650, 1000)
    assert s.as_dict() == {"share": 0.1, "unique": 10_000, "longest": 50, "gpu": 100, "cpu": 250, "disk": 650,
                           "total": 1000}  # fmt: skip


def test_every_feasible_split_adds_up_and_holds_the_longest_request():
    for unique, longest, share in itertools.product((0, 1, 7, 99, 1000, 12_345), (0, 1, 5, 80, 400), (0.01, 0.03, 0.2, 0.5, 1.0)):
        try:
            s = split_capacity(unique, longest, share)
        except ConfigError:
            assert round(share * unique) - max(longest, (round(share * unique) * 10 + 50) // 100) < 2
            continue
        assert s.total == round(share * unique)
        assert s.gpu >= longest and s.cpu >= 1 and s.disk >= 1
        assert s.gpu == max(longest, (s.total * 10 + 50) // 100)


def test_a_share_too_small_names_the_share_the_unique_count_and_the_longest_request():
    with pytest.raises(ConfigError) as info:
        split_capacity(MOONCAKE_UNIQUE, MOONCAKE_LONGEST, 0.008)
    msg = str(info.value)
    for part in ("--capacity-share 0.008", "351 blocks", "43924 unique blocks", "longest request, 374 blocks",
                 "at least 0.00856"):  # fmt: skip
        assert part in msg, msg
    with pytest.raises(ConfigError, match="no share is enough"):
        split_capacity(10, 9, 1.0)  # 10 blocks cannot hold a 9-block request and a CPU and disk block


@pytest.mark.parametrize("share", [0, -0.1, 1.01, float("nan"), float("inf"), True, "0.1"])
def test_share_outside_zero_to_one_is_refused(share):
    with pytest.raises(ConfigError, match="--capacity-share"):
        split_capacity(1000, 1, share)


def test_longest_request():
    assert longest_request([]) == 0
    assert longest_request([Request(0.0, 512, 1, (1,)), Request(1.0, 1500, 1, (1, 2, 3))]) == 3
