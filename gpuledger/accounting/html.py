"""The usage report as one self-contained HTML file: inline SVG charts drawn here, inline CSS, no scripts, no
network access at view time.

Charts: allocated GPU-hours over time stacked by account (each job's GPU-seconds spread evenly over its measured
interval, in day buckets, or hour buckets for spans under two days), the distribution of job efficiency
(jobs per 10 % bin, GPU-hours in the tooltip) and energy per group with its emissions. Every bar carries
``data-value`` (and ``data-series``) so that tests and scripts can read the numbers back from the DOM.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from html import escape
from typing import Any

from gpuledger.accounting.ledger import LedgerEntry
from gpuledger.accounting.report.period import in_period
from gpuledger.accounting.report.usage import UsageReport, usage_columns

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac")
W, H = 760, 300
PAD_L, PAD_R, PAD_T, PAD_B = 64, 16, 16, 46


def _ticks(vmax: float, n: int = 5) -> list[float]:
    if vmax <= 0:
        return [0.0]
    raw = vmax / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return [i * step for i in range(int(vmax / step + 1e-9) + 2) if i * step <= vmax * 1.0001 + step]


def _num(v: float) -> str:
    return f"{v:.3g}" if v < 1000 else f"{v:,.0f}"


def _axes(vmax: float, ylabel: str) -> tuple[list[str], float]:
    ticks = _ticks(vmax)
    top = max(ticks[-1], vmax) or 1.0
    ih = H - PAD_T - PAD_B
    parts = [f'<line x1="{PAD_L}" y1="{H - PAD_B}" x2="{W - PAD_R}" y2="{H - PAD_B}" stroke="#333"/>',
             f'<text x="12" y="{PAD_T + ih / 2:.0f}" transform="rotate(-90 12 {PAD_T + ih / 2:.0f})" '
             f'text-anchor="middle" class="lab">{escape(ylabel)}</text>']
    for t in ticks:
        y = H - PAD_B - ih * t / top
        parts.append(f'<line x1="{PAD_L}" y1="{y:.1f}" x2="{W - PAD_R}" y2="{y:.1f}" stroke="#ddd"/>'
                     f'<text x="{PAD_L - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick">{_num(t)}</text>')
    return parts, top


def stacked_bars(chart_id: str, labels: Sequence[str], series: Mapping[str, Sequence[float]], ylabel: str,
                 colors: Sequence[str] = PALETTE, notes: Sequence[str] | None = None) -> str:
    """Bars per label, stacked by series (in the given order), as an SVG figure; a legend when there are
    several series. ``notes`` (single series) replace the tooltips' text after the value."""
    n = max(len(labels), 1)
    totals = [math.fsum(s[i] for s in series.values()) for i in range(len(labels))]
    parts, top = _axes(max(totals, default=0.0), ylabel)
    iw, ih = W - PAD_L - PAD_R, H - PAD_T - PAD_B
    bw = iw / n
    every = max(1, math.ceil(n / 12))
    for i, lab in enumerate(labels):
        x = PAD_L + i * bw
        y = float(H - PAD_B)
        for k, (name, vals) in enumerate(series.items()):
            v = vals[i]
            if v <= 0:
                continue
            h = ih * v / top
            y -= h
            tip = f"{lab}: {_num(v)} {notes[i]}" if notes is not None else f"{name} {lab}: {_num(v)}"
            parts.append(f'<rect class="bar" data-series="{escape(name)}" data-label="{escape(lab)}" '
                         f'data-value="{v!r}" x="{x + bw * 0.1:.2f}" y="{y:.2f}" '
                         f'width="{bw * 0.8:.2f}" height="{h:.2f}" '
                         f'fill="{colors[k % len(colors)]}"><title>{escape(tip)}</title></rect>')
        if i % every == 0:
            parts.append(f'<text x="{x + bw / 2:.1f}" y="{H - PAD_B + 16}" text-anchor="middle" class="tick">'
                         f'{escape(lab)}</text>')
    legend = "".join(
        f'<span class="key"><i style="background:{colors[k % len(colors)]}"></i>{escape(name)}</span>'
        for k, name in enumerate(series)) if len(series) > 1 else ""
    return (f'<figure id="{chart_id}"><svg viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" '
            f'xmlns="http://www.w3.org/2000/svg">{"".join(parts)}</svg><figcaption>{legend}</figcaption></figure>')


# -- data for the charts ------------------------------------------------------------------------------------------
def usage_over_time(entries: Iterable[LedgerEntry], start: float, end: float
                    ) -> tuple[list[str], dict[str, list[float]]]:
    """Allocated GPU-hours per time bucket and account; each job spread evenly over [first_ts, last_ts]."""
    es = [e for e in entries if e.usage is not None]
    if not es:
        return [], {}
    lo = min(e.usage.first_ts for e in es)  # type: ignore[union-attr]
    hi = max(e.usage.last_ts for e in es)  # type: ignore[union-attr]
    if math.isfinite(start):
        lo = min(lo, start)
    if math.isfinite(end):
        hi = max(min(hi, end), lo)
    step = 3600.0 if hi - lo < 2 * 86400 else 86400.0
    b0 = math.floor(lo / step) * step
    nb = max(1, math.ceil((hi - b0) / step))
    fmt = "%m-%d %H:00" if step == 3600.0 else "%m-%d"
    labels = [datetime.fromtimestamp(b0 + i * step, UTC).strftime(fmt) for i in range(nb)]
    series: dict[str, list[float]] = {}
    for e in es:
        u = e.usage
        assert u is not None
        vals = series.setdefault(e.account, [0.0] * nb)
        a, b, gh = u.first_ts, u.last_ts, u.allocated_gpu_seconds / 3600.0
        if b <= a:
            i = min(max(int((a - b0) // step), 0), nb - 1)
            vals[i] += gh
            continue
        i0, i1 = int((a - b0) // step), int((b - b0) // step)
        for i in range(max(i0, 0), min(i1, nb - 1) + 1):
            s, t = max(a, b0 + i * step), min(b, b0 + (i + 1) * step)
            if t > s:
                vals[i] += gh * (t - s) / (b - a)
    return labels, dict(sorted(series.items()))


def efficiency_histogram(entries: Iterable[LedgerEntry], bins: int = 10) -> tuple[list[str], list[float], list[float]]:
    """Jobs and GPU-hours per efficiency bin (0-10 %, ..., 90-100 %)."""
    jobs, hours = [0.0] * bins, [0.0] * bins
    for e in entries:
        u = e.usage
        if u is None or u.efficiency is None:
            continue
        i = min(int(u.efficiency * bins), bins - 1)
        jobs[i] += 1
        hours[i] += u.allocated_gpu_seconds / 3600.0
    labels = [f"{100 * i // bins}-{100 * (i + 1) // bins}%" for i in range(bins)]
    return labels, jobs, hours


# -- the page -----------------------------------------------------------------------------------------------------
CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:24px 0 8px}
.meta{color:#555;font-size:12px} figure{margin:0} figcaption{font-size:12px;margin-top:4px}
.key{margin-right:12px;white-space:nowrap} .key i{display:inline-block;width:10px;height:10px;margin-right:4px}
svg .tick{font-size:11px;fill:#444} svg .lab{font-size:12px;fill:#222}
table{border-collapse:collapse;font-size:12px} th,td{padding:3px 8px;border-bottom:1px solid #ddd;text-align:right}
th:first-child,td:first-child{text-align:left} tr.total td{font-weight:bold;border-top:2px solid #333}
"""


def render_html(rep: UsageReport, entries: Sequence[LedgerEntry], title: str = "GPU usage report",
                manifest: Mapping[str, Any] | None = None, now: float | None = None) -> str:
    """The page for ``rep``; ``entries``: the ledger's entries, of which the charts draw what counts in the report's
    period as its table does (``report.period.in_period``: a requeued job's runs that ended there); ``now``: the
    report's instant of the period rule."""
    counted = in_period(entries, rep.period, now)
    labels, series = usage_over_time(counted, rep.period.start, rep.period.end)
    elabels, ejobs, ehours = efficiency_histogram(counted)
    groups = [r.group for r in rep.rows]
    energy = [r.energy_kwh for r in rep.rows]
    co2 = [f"kWh, {r.co2e_kg:.3g} kg CO2e" if r.co2e_kg is not None else "kWh" for r in rep.rows]
    cols = usage_columns(rep.by, rep.currency)
    head = "".join(f"<th>{escape(n)}</th>" for n, _ in cols)
    body = "".join(
        f'<tr{" class=total" if r is rep.total else ""}>'
        + "".join(f"<td>{escape(f(r))}</td>" for _, f in cols) + "</tr>"
        for r in [*rep.rows, rep.total])
    meta = (f"Period {escape(rep.period.label)} (UTC; jobs counted in the period they ended, a requeued job's runs "
            f"each in the one it ended); grouped by {escape(rep.by)}; {rep.total.jobs} jobs.")
    if manifest:
        meta += "<br>" + escape(", ".join(f"{k}: {v}" for k, v in manifest.items()))
    hist = stacked_bars("chart-efficiency", elabels, {"jobs": ejobs}, "jobs", (PALETTE[2],),
                        [f"jobs, {h:.3g} GPU-h" for h in ehours])
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{escape(title)}</title><style>{CSS}</style></head><body>"
        f"<h1>{escape(title)}</h1><p class=\"meta\">{meta}</p>"
        "<h2>Allocated GPU-hours over time, by account</h2>"
        + (stacked_bars("chart-usage", labels, series, "GPU-hours") if labels else "<p>No measured jobs.</p>")
        + "<h2>Job efficiency (SM-active / allocated GPU-time)</h2>" + hist
        + f"<h2>Energy by {escape(rep.by)}</h2>"
        + stacked_bars("chart-energy", groups, {"kWh": energy}, "kWh", (PALETTE[1],), co2)
        + f"<h2>Usage by {escape(rep.by)}</h2><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
        "</body></html>\n"
    )
