"""The gradient-ready curve: bytes of gradient ready vs time into backward.

Each bucket was handed over when its last gradient was ready; so the run gives points
``(ready_ms, bytes ready so far)``, one per bucket, and ``(0, 0)`` at backward start. Between
points, gradients are taken to appear at a steady rate (linear interpolation)::

    bytes ▲                    ●  all gradients (backward ends)
          |              ●-----
          |        ●----/          ● = a bucket handed over in the run
          |   ●---/
          ●--/─────────────────▶ ms into backward

Another bucketing closes its buckets at other byte offsets; each is ready when the curve
reaches its end offset (:meth:`ReadyCurve.time_at`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate


@dataclass(frozen=True)
class ReadyCurve:
    """Piecewise-linear ``bytes(t)`` through ``(0, 0)`` and one point per handed-over bucket."""

    times_ms: tuple[float, ...]
    cumulative_bytes: tuple[float, ...]

    @classmethod
    def from_buckets(cls, ready_ms: Sequence[float], nbytes: Sequence[int]) -> ReadyCurve:
        """The curve of buckets of ``nbytes`` handed over at ``ready_ms`` (in launch order)."""
        if len(ready_ms) != len(nbytes) or not nbytes:
            raise ValueError("the ready curve needs one ready time per bucket, and at least one bucket")
        times = [0.0]
        for t in ready_ms:  # hand-over times never go back (DDP launches in order)
            times.append(max(times[-1], float(t)))
        return cls(tuple(times), (0.0, *map(float, accumulate(nbytes))))

    @property
    def total_bytes(self) -> float:
        return self.cumulative_bytes[-1]

    def time_at(self, nbytes: float) -> float:
        """When ``nbytes`` of gradient are ready (ms into backward).

        >>> ReadyCurve.from_buckets([10.0, 30.0], [100, 100]).time_at(150)
        20.0
        """
        ys, xs = self.cumulative_bytes, self.times_ms
        if nbytes >= ys[-1]:
            return xs[-1]
        i = max(1, bisect.bisect_left(ys, nbytes))
        span = ys[i] - ys[i - 1]
        fraction = 0.0 if span == 0 else (nbytes - ys[i - 1]) / span
        return xs[i - 1] + fraction * (xs[i] - xs[i - 1])

    def ready_times(self, bucket_bytes: Sequence[float]) -> list[float]:
        """Ready time of each bucket of another bucketing of the same gradients, scaled so the
        bytes add up to the run's (the two counts differ only when parameters are unused)."""
        scale = self.total_bytes / max(1.0, float(sum(bucket_bytes)))
        return [self.time_at(end * scale) for end in accumulate(bucket_bytes)]
