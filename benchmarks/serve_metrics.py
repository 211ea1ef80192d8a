"""The pods' own counters around a `pdserve bench serve` run.

Before the load and after it, every `--metrics-url` (a pod's Prometheus
`/metrics`) is read; the report holds the differences, summed over the pods:

    prefix_cache_queries / _hits   prompt blocks looked up in / found in the
                                   prefix caches; hit_rate = hits / queries
    kv_bytes_sent / _received      `pdserve_kv_transfer_bytes_total` of the
                                   prefill role (sent) and the decode role
                                   (received); 0 on a colocated pod, which
                                   transfers nothing
    kv_bytes_saved                 `pdserve_kv_transfer_saved_bytes_total`:
                                   what decode pods held in their prefix
                                   caches and so did not receive
                                   (cache-miss-only transfer)

Both reads wait until the counters settle (two reads 0.2 s apart
agree, at most `settle_s`): a prefill pod counts a transfer's bytes when the
decode pod's verdict reaches it, which can be after the client has its last
token (the first token is sent before the verdict; a 1-token request ends
there; the "before" read follows the warm-up, whose transfers settle the
same way).

Where no URL is given the section says so in `note` and its figures are
None: the router does not list its pods' metrics addresses, but `pdserve up
--ready-file PATH` writes them, and `--up-ready-file PATH` reads them from there.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

# report field -> (sample name, role label or None for every role)
COUNTERS = {
    "prefix_cache_queries": ("pdserve_prefix_cache_queries_total", None),
    "prefix_cache_hits": ("pdserve_prefix_cache_hits_total", None),
    "kv_bytes_sent": ("pdserve_kv_transfer_bytes_total", "prefill"),
    "kv_bytes_received": ("pdserve_kv_transfer_bytes_total", "decode"),
    "kv_bytes_saved": ("pdserve_kv_transfer_saved_bytes_total", "decode"),
}


def urls_from_up_ready_file(path: Path) -> list[str]:
    """The pods' /metrics URLs from `pdserve up --ready-file PATH`."""
    try:
        pods = json.loads(path.read_text())["pods"]
        return [pod["metrics"] for pod in pods]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--up-ready-file {path}: not a `pdserve up` ready file "
                         f"({type(exc).__name__}: {exc})") from None


def scrape(urls: list[str], timeout_s: float = 10.0) -> dict[str, float]:
    """The COUNTERS summed over every URL. RuntimeError naming the URL that
    does not answer."""
    totals = dict.fromkeys(COUNTERS, 0.0)
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                text = response.read().decode()
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            raise RuntimeError(f"--metrics-url {url}: {exc}") from None
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                for field, (name, role) in COUNTERS.items():
                    if sample.name == name and role in (None, sample.labels.get("role")):
                        totals[field] += sample.value
    return totals


def scrape_settled(urls: list[str], settle_s: float = 5.0) -> dict[str, float]:
    """`scrape` once the counters stopped moving (see the module docstring)."""
    deadline = time.monotonic() + settle_s
    last = scrape(urls)
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = scrape(urls)
        if now == last:
            break
        last = now
    return last


def empty_report(note: str) -> dict:
    return {"urls": [], "note": note, **dict.fromkeys(COUNTERS), "prefix_cache_hit_rate": None}


def delta_report(urls: list[str], before: dict[str, float], after: dict[str, float]) -> dict:
    """after - before per counter, and the hit rate of the run's lookups."""
    delta = {field: after[field] - before[field] for field in COUNTERS}
    queries = delta["prefix_cache_queries"]
    rate = delta["prefix_cache_hits"] / queries if queries else None
    return {"urls": list(urls), "note": None, **delta, "prefix_cache_hit_rate": rate}
