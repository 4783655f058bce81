"""The sampling progress line: images counted by completed batch, the rate and ETA from those batches only.

A batch's images reach the writer together, after its whole sampling loop, so counting them one by one made
the first line read "images 1/512 | 0.0 img/s | eta 27h14m" (one image over a whole batch's time).
"""

import math
import time

from diffrelay import logs


class Progress:
    """`update(n)` after the n-th image: a line when a batch is complete and `every` seconds have passed since
    the last line (and always after the last image), else None. A text run's groups of (guidance, steps) may end
    in a short batch: its images are then counted with the next complete one."""

    def __init__(self, total: int, batch_size: int, every: float = 10.0, clock=time.monotonic):
        self.total, self.batch, self.every, self.clock = total, max(1, batch_size), every, clock
        self.start = self.last = clock()

    def update(self, n: int) -> str | None:
        if n % self.batch and n != self.total:
            return None  # mid-batch: the rest of it arrives at the same moment
        now = self.clock()
        if now - self.last <= self.every and n != self.total:
            return None
        self.last = now
        rate = n / max(now - self.start, 1e-9)
        return (f"batch {math.ceil(n / self.batch)}/{math.ceil(self.total / self.batch)} ({n}/{self.total} images) "
                f"| {rate:.3g} img/s | eta {logs.fmt_duration((self.total - n) / rate)}")
