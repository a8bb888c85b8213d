"""``with Timer() as t: ...`` then ``t.seconds``: wall time of a block (``perf_counter``)."""

from __future__ import annotations

import time


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
