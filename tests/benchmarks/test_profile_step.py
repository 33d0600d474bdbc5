"""``benchmarks/profile_step.py``'s launch-order listing (``--sequence``): the last call's
device events, split from earlier calls by an idle gap, with the idle time before each."""

import suite_paths  # tests/support: where the suite's pieces are
import os
import sys

sys.path.insert(0, str(suite_paths.BENCHMARKS))

from profile_step import last_call  # noqa: E402


def test_last_call_lists_the_last_calls_kernels_in_order_with_idle_gaps():
    spans = [  # (start us, duration us, name), out of order as a trace may hold them
        (1000.0, 5.0, "b2"), (0.0, 10.0, "a0"), (12.0, 3.0, "a1"),
        (1006.0, 2.0, "b3"), (990.0, 4.0, "b0"), (993.0, 6.0, "b1"),   # b1 overlaps b0
        (200.0, 1.0, "c0"),
    ]
    got = last_call(spans, gap_us=50.0)
    # calls: [a0, a1], [c0], [b0 .. b3]; b1 starts inside b0 (idle 0), b2 starts 1 us after
    # b1 ends, b3 1 us after b2
    assert got == [["b0", 0.0, 4.0, 0.0], ["b1", 3.0, 6.0, 0.0], ["b2", 10.0, 5.0, 1.0],
                   ["b3", 16.0, 2.0, 1.0]]
    assert last_call(spans, gap_us=2000.0)[0] == ["a0", 0.0, 10.0, 0.0]
    assert len(last_call(spans, gap_us=2000.0)) == len(spans)
    assert last_call([]) == []
