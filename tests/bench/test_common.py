"""The interval union that the e2e bench's busy shares and the profile summary both use."""

from __future__ import annotations

from bench.common import covered
from bench.e2e import _busy


def test_covered_counts_overlaps_once_and_ignores_empty_intervals():
    assert covered([(0, 1), (0.5, 2), (3, 3), (4, 3), (5, 6)]) == 3.0
    assert covered([]) == 0.0


def test_busy_clips_spans_to_the_window():
    spans = [{"start": s, "end": e} for s, e in [(0, 2), (1, 3), (5, 9), (-3, -1), (12, 15)]]
    assert _busy(spans, 0.5, 10) == 6.5  # [0.5, 3] and [5, 9]
