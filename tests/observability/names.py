"""Metric names for the observability tests: what a /metrics page exposes,
what a PromQL query or a prometheus-adapter rule refers to, and what
docs/observability.md's table lists.

Who uses it: test_chart_autoscaling.py (the dashboard's and the autoscaling
objects' metrics exist on live pods) and test_metrics_table.py (the table
matches what the pods register).
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TABLE_DOC = REPO_ROOT / "docs" / "observability.md"

# A pdserve metric name inside a PromQL expression or a rule's seriesQuery.
_NAME_RE = re.compile(r"\bpdserve_[a-z0-9_]+")
# One row of the table: | `pdserve_name` | type | ...
_ROW_RE = re.compile(r"^\|\s*`(pdserve_[a-z0-9_]+)`\s*\|\s*(\w+)\s*\|", re.MULTILINE)
_HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


def names_in(text: str) -> set[str]:
    """Every pdserve_* name a query or a rule mentions."""
    return set(_NAME_RE.findall(text))


def exposed_families(text: str) -> dict[str, str]:
    """Metric families of a Prometheus text page by name -> type, from its
    `# TYPE` lines (a labelled metric with no child yet still declares its
    family), pdserve_* only, less the `_created` timestamps."""
    families = {}
    for line in text.splitlines():
        if line.startswith("# TYPE pdserve_"):
            _, _, name, kind = line.split()
            if not name.endswith("_created"):  # prometheus_client's creation times
                families[name] = kind
    return families


def series_names(families: dict[str, str]) -> set[str]:
    """The names a query may use for these families: a histogram counts as
    present through its _bucket, _sum and _count series, and a counter
    under its name with or without _total."""
    names = set(families)
    for name, kind in families.items():
        if kind == "histogram":
            names |= {name + suffix for suffix in _HISTOGRAM_SERIES}
        if kind == "counter":
            names.add(name.removesuffix("_total"))
            names.add(name if name.endswith("_total") else name + "_total")
    return names


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def table_rows(text: str | None = None) -> dict[str, str]:
    """docs/observability.md's metric table: name -> type."""
    text = TABLE_DOC.read_text() if text is None else text
    rows: dict[str, str] = {}
    for name, kind in _ROW_RE.findall(text):
        assert name not in rows, f"{name} has two rows in {TABLE_DOC.name}"
        rows[name] = kind
    return rows
