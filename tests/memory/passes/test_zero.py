"""memory/passes/zero.py: the ranges each rank owns and one rank's persistent bytes under ZeRO."""

from __future__ import annotations

import pytest

from minidl.memory.passes.zero import owned_ranges


def test_owned_ranges_partition_the_flat_parameters():
    sizes = [5, 3, 8, 1]
    for ranks in (1, 2, 3, 4, 17):
        seen = []
        for r in range(ranks):
            rs = owned_ranges(sizes, ranks, r)
            assert sum(hi - lo for _, lo, hi in rs) <= -(-sum(sizes) // ranks)
            seen += [(i, k) for i, lo, hi in rs for k in range(lo, hi)]
        assert seen == [(i, k) for i, n in enumerate(sizes) for k in range(n)]
    assert owned_ranges(sizes, 2, 0) == [(0, 0, 5), (1, 0, 3), (2, 0, 1)]
    assert owned_ranges(sizes, 2, 1) == [(2, 1, 8), (3, 0, 1)]
    with pytest.raises(ValueError, match="rank 2 is not a rank of 2"):
        owned_ranges(sizes, 2, 2)
