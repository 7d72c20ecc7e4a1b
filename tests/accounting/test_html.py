"""The HTML report renders in a real browser: headless Chromium (Debian package `chromium`) dumps the DOM and takes
a screenshot; the charts must be there with the report's numbers and must paint."""

from __future__ import annotations

import math
import re
import shutil
import struct
import subprocess
import zlib
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gpuledger.accounting.html import PALETTE, render_html
from gpuledger.accounting.ledger import join
from gpuledger.accounting.report.period import parse_period
from gpuledger.accounting.report.settings import ReportSettings
from gpuledger.accounting.report.usage import usage_report
from gpuledger.schema.records import JobRecord, JobUsage

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(autouse=True)
def _needs_chromium() -> None:
    # A missing browser is a failure, not a skip: make test installs Debian's chromium through .ci/ensure-debs.
    if CHROMIUM is None:
        pytest.fail("needs Debian's chromium package (apt-get install chromium)")


def T(d: int, h: int = 0) -> float:
    return datetime(2026, 10, d, h, tzinfo=UTC).timestamp()


def _entries():
    records, usages = [], []
    for i in range(30):
        acct = ("proj_a", "proj_b", "proj_c")[i % 3]
        start, end = T(1 + i % 28, i % 24), T(1 + i % 28, i % 24) + 3600 * (1 + i % 5)
        gpus = 1 + i % 4
        alloc = (end - start) * gpus
        eff = (i % 10) / 10 + 0.05
        records.append(JobRecord(str(100 + i), user=f"user{i % 4}", account=acct, start=start, end=end, gpus=gpus))
        usages.append(JobUsage(str(100 + i), "n1", "*", start, end, 100, alloc, alloc * eff, alloc * 400.0,
                               dram_bw_mean=0.3, model="NVIDIA H200", gpus=gpus))
    return join(records, usages)


def _chromium(*args: str, tmp: Path) -> subprocess.CompletedProcess:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp / 'profile'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """A minimal PNG decoder (8-bit RGB/RGBA, non-interlaced): what Chromium writes."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            width, height, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", chunk)
            assert depth == 8 and ctype in (2, 6) and interlace == 0
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + n
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for x in range(stride):
            a = line[x - bpp] if x >= bpp else 0
            b, c = prev[x], (prev[x - bpp] if x >= bpp else 0)
            if f == 1:
                line[x] = (line[x] + a) & 255
            elif f == 2:
                line[x] = (line[x] + b) & 255
            elif f == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, bpp, rows


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("html")
    entries = _entries()
    rep = usage_report(entries, "account", parse_period("2026-10"), ReportSettings(co2e_kg_per_kwh=0.4))
    path = tmp / "report.html"
    path.write_text(render_html(rep, entries, manifest={"audit head": "42:abcd"}))
    return tmp, path, rep


def test_html_is_self_contained(page):
    _, path, _ = page
    text = path.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text), "no network resources"
    assert "<script" not in text and "@import" not in text


def test_charts_render_in_chromium_with_the_report_numbers(page):
    tmp, path, rep = page
    r = _chromium("--dump-dom", path.as_uri(), tmp=tmp)
    assert r.returncode == 0, r.stderr[-2000:]
    dom = r.stdout
    charts = {}
    for cid in ("chart-usage", "chart-efficiency", "chart-energy"):
        m = re.search(rf'<figure id="{cid}">(.*?)</figure>', dom, re.S)
        assert m, f"{cid} missing from the rendered DOM"
        charts[cid] = [float(v) for v in re.findall(r'class="bar"[^>]*data-value="([^"]+)"', m.group(1))]
        assert charts[cid], f"{cid} has no bars"
    # Every GPU-hour of the period is in the time chart; every measured job in the histogram; energy per account.
    assert math.fsum(charts["chart-usage"]) == pytest.approx(rep.total.allocated_gpu_hours, rel=1e-9)
    assert sum(charts["chart-efficiency"]) == rep.total.jobs == 30
    assert sorted(charts["chart-energy"]) == sorted(r.energy_kwh for r in rep.rows)
    assert dom.count('data-series="proj_') >= 3


def test_screenshot_shows_the_charts(page):
    tmp, path, _ = page
    shot = tmp / "shot.png"
    r = _chromium(f"--screenshot={shot}", "--window-size=900,1400", "--hide-scrollbars", path.as_uri(), tmp=tmp)
    assert r.returncode == 0 and shot.exists(), r.stderr[-2000:]
    width, bpp, rows = _png_pixels(shot.read_bytes())
    counts = {c: 0 for c in PALETTE[:3]}
    want = {bytes.fromhex(c[1:]): c for c in counts}
    non_white = 0
    for row in rows:
        for x in range(0, width * bpp, bpp):
            px = row[x:x + 3]
            if px in want:
                counts[want[px]] += 1
            if px != b"\xff\xff\xff":
                non_white += 1
    assert non_white > 0.03 * width * len(rows)
    # the three accounts' colours are painted (the bars, not just the legend's 10 px squares)
    assert all(n > 2000 for n in counts.values()), counts
