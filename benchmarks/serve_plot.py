"""PNG charts of `pdserve bench serve` runs, one line per run (its --label):

    ttft_cdf.png         CDF of time to first token
    itl_cdf.png          CDF of inter-token latency (every gap of every request)
    e2e_cdf.png          CDF of end-to-end latency
    throughput.png       output tokens/s over the run, in fixed time bins

`pdserve bench serve --plot-dir DIR` draws one run; `pdserve bench
serve-plot a.json b.json --out DIR` lays several result files on the same
charts (e.g. disaggregated vs colocated). matplotlib's Agg backend: no display.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HELP = "Overlay `pdserve bench serve` result JSONs: latency CDFs and throughput over time (PNG)."

CDFS = (("ttft_cdf.png", "time to first token (ms)"),
        ("itl_cdf.png", "inter-token latency (ms)"),
        ("e2e_cdf.png", "end-to-end latency (ms)"))


def samples_ms(result: dict, chart: str) -> list[float]:
    """One CDF's samples of a run, from its completed requests."""
    ok = [r for r in result["requests"] if r["error"] is None]
    if chart == "ttft_cdf.png":
        return [r["ttft_s"] * 1e3 for r in ok]
    if chart == "itl_cdf.png":
        return [gap * 1e3 for r in ok for gap in r["itl_s"]]
    return [r["e2e_s"] * 1e3 for r in ok]


def token_times(result: dict) -> list[float]:
    """When each output token reached the client, seconds since the run began."""
    times = []
    for r in result["requests"]:
        if r["error"] is not None or not r["output_tokens"]:
            continue
        now = r["start_s"] + r["ttft_s"]
        first_chunk = r["output_tokens"] - len(r["itl_s"])  # tokens in the first chunk
        times.extend([now] * first_chunk)
        for gap in r["itl_s"]:
            now += gap
            times.append(now)
    return times


def throughput_series(result: dict, bin_s: float) -> tuple[list[float], list[float]]:
    """(bin midpoints in s, output tokens/s in each bin) over the run."""
    if not bin_s > 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s}")
    num_bins = max(1, int(result["duration_s"] / bin_s) + 1)
    counts = [0] * num_bins
    for t in token_times(result):
        counts[min(num_bins - 1, int(t / bin_s))] += 1
    return [(i + 0.5) * bin_s for i in range(num_bins)], [c / bin_s for c in counts]


def plot_runs(results: list[dict], out_dir: Path) -> list[Path]:
    """Draw the four charts of `results` into `out_dir`; the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not results:
        raise ValueError("plot_runs needs at least one result")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, xlabel in CDFS:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        low, high = float("inf"), 0.0
        for result in results:
            values = sorted(samples_ms(result, name))
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=result["label"])
                low = min(low, values[0]) if values[0] > 0 else low
                high = max(high, values[-1])
        if high > 100 * low:  # tails an order of magnitude apart: log axis shows both
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        written.append(out_dir / name)
    longest = max(r["duration_s"] for r in results)
    bin_s = max(0.01, longest / 40)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for result in results:
        xs, ys = throughput_series(result, bin_s)
        ax.plot(xs, ys, marker=".", label=result["label"])
    ax.set_xlabel(f"time since the run began (s; {bin_s:.2g} s bins)")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "throughput.png", dpi=110)
    plt.close(fig)
    written.append(out_dir / "throughput.png")
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="+", metavar="RESULT.json",
                        help="`pdserve bench serve --out` files, one line each on every chart")
    parser.add_argument("--out", required=True, metavar="DIR", help="where the PNGs go")


def main(args: argparse.Namespace) -> int:
    results = []
    for path in args.results:
        try:
            result = json.loads(Path(path).read_text())
            result["requests"], result["label"], result["duration_s"]  # noqa: B018
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"pdserve bench serve-plot: error: {path}: not a `pdserve bench serve` "
                  f"result ({type(exc).__name__}: {exc})", file=sys.stderr)
            return 2
        results.append(result)
    for path in plot_runs(results, Path(args.out)):
        print(path)
    return 0
