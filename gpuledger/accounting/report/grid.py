"""Grid carbon intensity over time (g CO2e per kWh), from a CSV of `time,g_co2e_per_kwh` rows."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from gpuledger.accounting.report.errors import ReportError
from gpuledger.accounting.report.period import parse_time


@dataclass(frozen=True, slots=True)
class GridIntensity:
    """A step function of grid carbon intensity (g CO2e/kWh): each value holds until the next time.

    Before the first point the first value holds, after the last point the last one (documented clamping).
    """

    times: tuple[float, ...]
    values: tuple[float, ...]
    cum: tuple[float, ...]  # integral of the step function from times[0] to times[i]

    @classmethod
    def from_points(cls, points: Sequence[tuple[float, float]], where: str = "grid intensity") -> GridIntensity:
        if not points:
            raise ReportError(f"{where}: no data points")
        pts = sorted(points)
        times = tuple(t for t, _ in pts)
        if len(set(times)) != len(times):
            raise ReportError(f"{where}: duplicate time in the series")
        vals = tuple(v for _, v in pts)
        cum = [0.0]
        for i in range(1, len(pts)):
            cum.append(cum[-1] + vals[i - 1] * (times[i] - times[i - 1]))
        return cls(times, vals, tuple(cum))

    @classmethod
    def from_csv(cls, text: str, where: str = "grid intensity CSV") -> GridIntensity:
        points: list[tuple[float, float]] = []
        first = True
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            header, first = first, False
            cells = [c.strip() for c in line.split(",")]
            if len(cells) != 2:
                raise ReportError(f"{where} line {n}: expected `time,g_co2e_per_kwh`, got {line!r}")
            try:
                value = float(cells[1])
            except ValueError:
                if header:
                    continue  # the first line may be a header
                raise ReportError(f"{where} line {n}: intensity {cells[1]!r} is not a number") from None
            if not (math.isfinite(value) and value >= 0):
                raise ReportError(f"{where} line {n}: intensity {value!r} must be a finite number >= 0")
            t = parse_time(cells[0], f"{where} line {n}: time")
            points.append((t, value))
        return cls.from_points(points, where)

    def _integral_to(self, t: float) -> float:
        ts = self.times
        if t <= ts[0]:
            return (t - ts[0]) * self.values[0]
        i = bisect.bisect_right(ts, t) - 1
        return self.cum[i] + self.values[i] * (t - ts[i])

    def mean(self, a: float, b: float) -> float:
        """Time-weighted mean intensity over [a, b] (the value at a when b <= a)."""
        if b <= a:
            i = max(bisect.bisect_right(self.times, a) - 1, 0)
            return self.values[i]
        return (self._integral_to(b) - self._integral_to(a)) / (b - a)
