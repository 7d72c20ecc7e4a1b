"""Usage decay exactly as slurmctld's priority/multifactor decay thread applies it.

What is modelled (from ``_decay_thread`` and ``_apply_new_usage`` in priority_multifactor.c):

* Slurm's per-second decay factor is ``df = 1 - 0.693 / PriorityDecayHalfLife`` (a first-order
  approximation of ``2**(-1/half_life)``; over one half-life it leaves 0.49960 instead of 0.5).
  ``PriorityDecayHalfLife=0`` means no decay. Override with ``per_second_factor=``.
* The decay thread runs every ``PriorityCalcPeriod``; here its runs ("ticks") fall on the multiples
  of the period since the epoch. At each tick all usage is multiplied by ``df**(tick - previous
  tick)``, then each running job adds the usage it accrued since the previous tick (or since it
  started), itself multiplied by ``df**(seconds accrued)``.
* A job that ends between ticks adds its last piece at its end time (the same ``df**seconds``
  factor), and that piece then takes the full decay at the next tick.
* A charge ``(key, start, end, amount)`` is spread uniformly over ``[start, end]`` (a rate of
  ``amount / (end - start)``; ``start == end`` adds it whole at ``start``). Pieces are added only
  once their add time is <= ``now``: usage a running job accrued after the last tick is not yet in
  Slurm's numbers, and so not in ours.
* ``PriorityUsageResetPeriod``: DAILY / WEEKLY (Sunday) / MONTHLY / QUARTERLY / YEARLY boundaries
  at local midnight in ``tz`` (default: this machine's zone, like slurmctld); at the first tick at or
  after a boundary all usage is zeroed *before* that tick's new usage is added (so the piece accrued
  just before the boundary survives, as in
  Slurm). NONE never resets; NOW resets once when slurmctld starts, which from an empty ledger is
  the same as NONE.

Not modelled: QOS UsageFactor / NoDecay (fold them into ``amount``), ``DBL_MIN`` clamping, and
slurmctld restarts (Slurm then decays over the whole gap at once, which our tick grid also does).
"""

from __future__ import annotations

import math
import re
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TypeVar
from zoneinfo import ZoneInfo

import numpy as np

Key = TypeVar("Key", bound=Hashable)  # what usage is decayed per (an association)
RESET_PERIODS = ("NONE", "NOW", "DAILY", "WEEKLY", "MONTHLY", "QUARTERLY", "YEARLY")


class SlurmConfigError(ValueError):
    """Bad duration or ``scontrol show config`` text; the message names the key or line."""


_DURATION = re.compile(
    r"^(?:(?P<days>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"  # D-H[:M[:S]]
    r"|(?P<a>\d+)(?::(?P<b>\d+)(?::(?P<c>\d+))?)?)$"  # M | M:S | H:M:S
)


def parse_slurm_duration(text: str) -> int:
    """Seconds in a Slurm duration: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``.

    ``scontrol show config`` prints ``00:05:00`` or ``1-00:00:00``; slurm.conf also takes ``5``
    (minutes) and ``7-0``. UNLIMITED/INFINITE are rejected: no fairshare setting means that.
    """
    s = text.strip()
    m = _DURATION.match(s)
    if not m:
        raise SlurmConfigError(f"bad Slurm duration {text!r}")
    if m["days"] is not None:
        days, hours = int(m["days"]), int(m["dh"])
        minutes, seconds = int(m["dm"] or 0), int(m["ds"] or 0)
        return ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    a, b, c = m["a"], m["b"], m["c"]
    if c is not None:
        return (int(a) * 60 + int(b)) * 60 + int(c)
    if b is not None:
        return int(a) * 60 + int(b)
    return int(a) * 60


@dataclass(frozen=True, slots=True)
class PriorityConfig:
    """The fairshare-relevant settings of ``scontrol show config``."""

    half_life_s: int = 7 * 86400
    calc_period_s: int = 300
    reset_period: str = "NONE"
    flags: tuple[str, ...] = ()
    dampening: int = 1
    max_age_s: int = 7 * 86400
    weights: dict[str, int] = field(default_factory=dict)

    @property
    def fair_tree(self) -> bool:
        return "NO_FAIR_TREE" not in self.flags


def parse_priority_config(text: str) -> PriorityConfig:
    """Read ``scontrol show config`` output (all of it or ``| grep -i priority``).

    Missing keys keep Slurm's defaults (half-life 7 days, calc period 5 minutes, reset NONE,
    dampening 1). ``(null)`` counts as missing.
    """
    values: dict[str, tuple[int, str]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if "=" not in line:
            continue
        key, _, value = line.partition("=")
        values[key.strip()] = (n, value.strip())

    def get(key: str) -> tuple[int, str] | None:
        item = values.get(key)
        if item is None or item[1] in ("", "(null)"):
            return None
        return item

    def duration(key: str, default: int) -> int:
        item = get(key)
        if item is None:
            return default
        try:
            return parse_slurm_duration(item[1])
        except SlurmConfigError as e:
            raise SlurmConfigError(f"line {item[0]}: {key}: {e}") from None

    def integer(key: str, default: int) -> int:
        item = get(key)
        if item is None:
            return default
        try:
            return int(item[1])
        except ValueError:
            raise SlurmConfigError(f"line {item[0]}: {key} = {item[1]!r} is not an integer") from None

    reset = get("PriorityUsageResetPeriod")
    reset_period = "NONE" if reset is None else reset[1].upper()
    if reset_period not in RESET_PERIODS:
        raise SlurmConfigError(f"line {reset[0]}: unknown PriorityUsageResetPeriod {reset[1]!r}")  # type: ignore[index]
    flags_item = get("PriorityFlags")
    flags = tuple(f.strip().upper() for f in flags_item[1].split(",") if f.strip()) if flags_item else ()
    weights = {
        k[len("PriorityWeight"):]: integer(k, 0)
        for k in values
        if k.startswith("PriorityWeight") and k != "PriorityWeightTRES" and get(k) is not None
    }
    return PriorityConfig(
        half_life_s=duration("PriorityDecayHalfLife", 7 * 86400),
        calc_period_s=duration("PriorityCalcPeriod", 300),
        reset_period=reset_period,
        flags=flags,
        dampening=integer("FairShareDampeningFactor", 1),
        max_age_s=duration("PriorityMaxAge", 7 * 86400),
        weights=weights,
    )


def slurm_decay_factor(half_life_s: float) -> float:
    """Slurm's per-second decay factor: ``1 - 0.693/half_life``; 1 (no decay) for half-life 0."""
    if half_life_s < 0:
        raise ValueError(f"half-life must be >= 0, got {half_life_s}")
    return 1.0 - 0.693 / half_life_s if half_life_s > 0 else 1.0


def last_reset_boundary(period: str, t: float, tz: str | None = None) -> float | None:
    """The latest PriorityUsageResetPeriod boundary at or before ``t`` (None for NONE/NOW), at midnight in ``tz``
    (an IANA zone name; None or "" = this machine's local zone, where slurmctld cuts them)."""
    period = period.upper()
    if period not in RESET_PERIODS:
        raise ValueError(f"unknown reset period {period!r}; one of {RESET_PERIODS}")
    if period in ("NONE", "NOW"):
        return None
    zone = ZoneInfo(tz) if tz else None  # None: naive local time, its DST offset applied by timestamp()
    d = datetime.fromtimestamp(t, zone).replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "WEEKLY":  # Slurm resets at the start of Sunday (tm_wday 0)
        d = d - timedelta(days=(d.weekday() + 1) % 7)
    elif period == "MONTHLY":
        d = d.replace(day=1)
    elif period == "QUARTERLY":
        d = d.replace(day=1, month=(d.month - 1) // 3 * 3 + 1)
    elif period == "YEARLY":
        d = d.replace(day=1, month=1)
    # Rebuild from the wall clock so the zone's DST offset of that date applies.
    d = datetime(d.year, d.month, d.day, tzinfo=zone)
    return d.timestamp()


def _decay_factor(half_life_s: float, calc_period_s: int, per_second_factor: float | None) -> float:
    if not (isinstance(calc_period_s, int) and calc_period_s > 0):
        raise ValueError(f"calc_period_s must be a positive integer, got {calc_period_s!r}")
    df = slurm_decay_factor(half_life_s) if per_second_factor is None else float(per_second_factor)
    if not 0.0 < df <= 1.0:
        raise ValueError(f"per-second decay factor must be in (0, 1], got {df}")
    return df


def decayed_usage(
    charges: Iterable[tuple[Key, float, float, float]],
    now: float,
    half_life_s: float,
    calc_period_s: int = 300,
    reset: str = "NONE",
    tz: str | None = None,
    per_second_factor: float | None = None,
) -> dict[Key, float]:
    """Slurm's decayed raw usage per key at ``now`` (see the module docstring for the model).

    ``charges`` are ``(key, start_ts, end_ts, amount)``; every key seen is in the result.
    """
    df = _decay_factor(half_life_s, calc_period_s, per_second_factor)
    P = calc_period_s
    J = math.floor(now / P)  # index of the last tick at or before now
    t_last = J * P
    boundary = last_reset_boundary(reset, t_last, tz)
    # Additions before the first tick at/after the latest boundary were zeroed by that reset.
    reset_tick = -math.inf if boundary is None else math.ceil(boundary / P) * P
    D = df**P

    def mult(x: float) -> float:
        # decay still to come for usage added at x: every tick after x's period start up to t_last
        return df ** (t_last - math.floor(x / P) * P)

    out: dict[Key, float] = {}
    for n, (key, start, end, amount) in enumerate(charges, 1):
        if not all(math.isfinite(v) for v in (start, end, amount)):
            raise ValueError(f"charge {n} ({key!r}): start, end and amount must be finite numbers")
        if end < start:
            raise ValueError(f"charge {n} ({key!r}): end {end} before start {start}")
        if amount < 0:
            raise ValueError(f"charge {n} ({key!r}): negative amount {amount}")
        out.setdefault(key, 0.0)
        if end == start:
            if start <= now and start >= reset_tick:
                out[key] += amount * mult(start)
            continue
        rate = amount / (end - start)

        def piece(a: float, b: float, rate: float = rate) -> float:
            # [a, b] accrues at b (a tick, or the job's end inside a period)
            if b > now or b < reset_tick:
                return 0.0
            length = b - a
            return rate * length * df**length * mult(b)

        first_tick = math.ceil(start / P) * P
        if first_tick >= end:
            out[key] += piece(start, end)
            continue
        total = piece(start, first_tick) if first_tick > start else 0.0
        last_tick = math.floor(end / P) * P
        # full periods ending at ticks j*P for j in [j_from, j_to], each added at its tick
        j_from = max(first_tick // P + 1, math.ceil(reset_tick / P) if reset_tick > -math.inf else -math.inf)
        j_to = min(last_tick // P, J)
        if j_to >= j_from:
            count = int(j_to - j_from + 1)
            per = rate * P * D
            if D == 1.0:
                total += per * count
            else:
                total += per * D ** (J - j_to) * (1.0 - D**count) / (1.0 - D)
        if end > last_tick:
            total += piece(last_tick, end)
        out[key] += total
    return out


def _powers(base: float, exponents: np.ndarray) -> np.ndarray:
    """``base ** e`` for each of ``exponents``, by Python's own ``**`` (C ``pow``, as :func:`decayed_usage` takes
    it; numpy's may round differently), once per distinct exponent."""
    distinct, where = np.unique(exponents, return_inverse=True)
    return np.array([base**e for e in distinct.tolist()], dtype=float)[where].reshape(exponents.shape)


def decayed_usage_batch(
    charges: Sequence[tuple[Key, float, float, float]],
    now: float,
    half_life_s: float,
    calc_period_s: int = 300,
    reset: str = "NONE",
    tz: str | None = None,
    per_second_factor: float | None = None,
) -> dict[Key, float]:
    """:func:`decayed_usage`, the reference, over many charges at once: its arithmetic step for step in the same
    order over arrays, so the same numbers to the bit (tests/accounting/test_decay.py holds the two equal). For
    `audit verify`, which recomputes every job's decay in every fairshare entry. Start, end and amount are ints or
    floats; charges the reference rejects are passed to it, so they fail with its message."""
    df = _decay_factor(half_life_s, calc_period_s, per_second_factor)
    P = calc_period_s
    J = math.floor(now / P)
    t_last = J * P
    boundary = last_reset_boundary(reset, t_last, tz)
    if not charges:
        return {}
    try:
        _, *times = zip(*charges)
        start, end, amount = (np.array(v, dtype=float) for v in times)
    except (TypeError, ValueError):
        return decayed_usage(charges, now, half_life_s, calc_period_s, reset, tz, per_second_factor)
    if not (np.isfinite(start).all() and np.isfinite(end).all() and np.isfinite(amount).all()
            and (end >= start).all() and (amount >= 0).all()):
        return decayed_usage(charges, now, half_life_s, calc_period_s, reset, tz, per_second_factor)
    reset_tick = -math.inf if boundary is None else math.ceil(boundary / P) * P
    D = df**P
    zero = np.zeros_like(start)

    def mult(x: np.ndarray) -> np.ndarray:
        return _powers(df, t_last - np.floor(x / P) * P)

    with np.errstate(all="ignore"):  # (values masked out below may overflow or divide by zero)
        rate = amount / (end - start)

        def piece(a: np.ndarray, b: np.ndarray, use: np.ndarray) -> np.ndarray:
            use = use & (b <= now) & (b >= reset_tick)
            a, b, r = a[use], b[use], rate[use]
            length = b - a
            out = zero.copy()
            out[use] = r * length * _powers(df, length) * mult(b)
            return out

        point = end == start
        total = zero.copy()
        at = point & (start <= now) & (start >= reset_tick)
        total[at] = amount[at] * mult(start[at])
        first_tick = np.ceil(start / P) * P
        single = ~point & (first_tick >= end)
        total += piece(start, end, single)
        spread = ~point & ~single
        total += piece(start, first_tick, spread & (first_tick > start))
        last_tick = np.floor(end / P) * P
        j_from = np.ceil(start / P) + 1
        if reset_tick > -math.inf:
            j_from = np.maximum(j_from, math.ceil(reset_tick / P))
        j_to = np.minimum(np.floor(end / P), J)
        mid = spread & (j_to >= j_from)
        count = (j_to - j_from + 1)[mid]
        per = rate[mid] * P * D
        middle = zero.copy()
        if D == 1.0:
            middle[mid] = per * count
        else:
            middle[mid] = per * _powers(D, J - j_to[mid]) * (1.0 - _powers(D, count)) / (1.0 - D)
        total += middle
        total += piece(last_tick, end, spread & (end > last_tick))
    # each key's pieces added up one after another in the charges' order, as the reference adds them
    index: dict[Key, int] = {}
    codes = np.array([index.setdefault(c[0], len(index)) for c in charges])
    order = np.argsort(codes, kind="stable")
    first = np.searchsorted(codes[order], np.arange(len(index)))  # where each key's pieces start in ``order``
    count = np.diff(np.append(first, len(order)))
    sums = np.zeros(len(index))
    live = np.arange(len(index))
    for n in range(int(count.max())):
        live = live[count[live] > n]
        sums[live] += total[order[first[live] + n]]
    return dict(zip(index, sums.tolist()))
