"""Report settings: the ``[report]`` table of gpuledger.toml, validated."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuledger.accounting.charge import model_value
from gpuledger.accounting.report.errors import ReportError
from gpuledger.accounting.report.grid import GridIntensity
from gpuledger.collector.config import ConfigError, read_toml
from gpuledger.schema.text import NotText, read_text

REPORT_CONFIG_DOC = """\
[report]                         # all optional
currency = "EUR"                 # shown next to costs
price_per_kwh = 0.25             # energy price
co2e_kg_per_kwh = 0.35           # constant grid emission factor (kg CO2e per kWh)
grid_intensity_csv = "grid.csv"  # or a time series (relative to the data dir): rows `time,g_co2e_per_kwh`,
                                 # time as unix seconds or ISO 8601; overrides the constant factor
idle_threshold = 0.05            # a GPU whose mean SM activity is below this is idle (report idle, job notes)
retention_days = 365             # job records that ended longer ago get pseudonymous user names
[report.price_per_gpu_hour]      # price per allocated GPU-hour by model, by the rule of accounting.charge's
default = 1.0                    # model_weights (charge.model_value): the exact name, else the longest
"H200" = 3.2                     # case-insensitive substring of the model ("H200" matches "NVIDIA H200"; ties by
                                 # name), else for Slurm's gres type the model it names ("h200" names
                                 # "NVIDIA H200"), else `default`. A measured GPU's model as fairshare weighs it
                                 # (Slurm's typed gres over a node's name for it); allocated GPU-hours no agent
                                 # observed at the price of the node's measured model where known, else of
                                 # Slurm's model (`default` when Slurm names none): never free. A report that
                                 # meets a model this table does not price, without a `default`, is refused
                                 # (exit 2, naming the model and a job): `default = 0` makes the rest free
[report.rules]                   # efficiency notes of `report job` (see accounting.jobreport.Rules)
"""


@dataclass(frozen=True, slots=True)
class ReportSettings:
    currency: str = ""
    price_per_kwh: float = 0.0
    price_per_gpu_hour: Mapping[str, float] = field(default_factory=dict)
    co2e_kg_per_kwh: float | None = None
    grid: GridIntensity | None = None
    idle_threshold: float = 0.05
    retention_days: float | None = None
    rules: Mapping[str, float] = field(default_factory=dict)

    @property
    def priced(self) -> bool:
        return bool(self.price_per_gpu_hour) or self.price_per_kwh > 0

    def gpu_hour_price(self, model: str, gres: bool = False) -> float | None:
        """The price of a GPU-hour on ``model`` (``gres``: on Slurm's gres type): the charge's model-weight rule
        (``charge.model_value``) over the priced models, else ``default``; None when a table without ``default``
        prices no such model (0.0 without a table: GPU-hours unpriced by design, the cost is energy only)."""
        if not self.price_per_gpu_hour:
            return 0.0
        price = model_value({k: v for k, v in self.price_per_gpu_hour.items() if k != "default"}, model, gres)
        return self.price_per_gpu_hour.get("default") if price is None else price


_REPORT_KEYS = {"currency", "price_per_kwh", "price_per_gpu_hour", "co2e_kg_per_kwh", "grid_intensity_csv",
                "idle_threshold", "retention_days", "rules"}


def report_settings(config: Mapping[str, Any], base_dir: str | Path = ".", where: str = "<config>") -> ReportSettings:
    """Validate the ``[report]`` table of a parsed gpuledger.toml (see REPORT_CONFIG_DOC)."""
    t = config.get("report", {})
    if not isinstance(t, Mapping):
        raise ReportError(f"{where}: [report] must be a table")
    unknown = sorted(set(t) - _REPORT_KEYS)
    if unknown:
        raise ReportError(f"{where}: report.{unknown[0]}: unknown setting (known: {', '.join(sorted(_REPORT_KEYS))})")

    def num(key: str, value: Any, lo: float = 0.0, hi: float | None = None) -> float:
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or not lo <= value <= (math.inf if hi is None else hi)):
            within = f">= {lo:g}" if hi is None else f"in [{lo:g}, {hi:g}]"
            raise ReportError(f"{where}: report.{key}: expected a finite number {within}, got {value!r}")
        return float(value)

    prices = t.get("price_per_gpu_hour", {})
    if not isinstance(prices, Mapping):
        raise ReportError(f"{where}: report.price_per_gpu_hour must be a table of model = price")
    rules = t.get("rules", {})
    if not isinstance(rules, Mapping):
        raise ReportError(f"{where}: report.rules must be a table")
    grid = None
    if "grid_intensity_csv" in t:
        p = Path(base_dir) / str(t["grid_intensity_csv"])
        try:
            grid = GridIntensity.from_csv(read_text(p), str(p))
        except OSError as e:
            raise ReportError(f"{where}: report.grid_intensity_csv: cannot read {p}: {e.strerror}") from None
        except NotText as e:
            raise ReportError(f"{where}: report.grid_intensity_csv: {e}") from None
    currency = t.get("currency", "")
    if not isinstance(currency, str):
        raise ReportError(f"{where}: report.currency must be text")
    return ReportSettings(
        currency=currency,
        price_per_kwh=num("price_per_kwh", t.get("price_per_kwh", 0.0)),
        price_per_gpu_hour={str(k): num(f"price_per_gpu_hour.{k}", v) for k, v in prices.items()},
        co2e_kg_per_kwh=num("co2e_kg_per_kwh", t["co2e_kg_per_kwh"]) if "co2e_kg_per_kwh" in t else None,
        grid=grid,
        idle_threshold=num("idle_threshold", t.get("idle_threshold", 0.05), 0.0, 1.0),
        retention_days=num("retention_days", t["retention_days"]) if "retention_days" in t else None,
        rules={str(k): num(f"rules.{k}", v) for k, v in rules.items()},
    )


def load_report_settings(data_dir: str | Path, config: str | Path | None = None) -> ReportSettings:
    """From ``config`` or ``<data-dir>/gpuledger.toml`` (defaults when the default file is absent)."""
    path = Path(config) if config is not None else Path(data_dir) / "gpuledger.toml"
    if not path.exists():
        if config is not None:
            raise ReportError(f"{path}: configuration file not found")
        return ReportSettings()
    try:
        data = read_toml(path)
    except ConfigError as e:
        raise ReportError(str(e)) from None
    return report_settings(data, path.parent, str(path))
