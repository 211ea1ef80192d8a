"""`pdserve bench soak`: minutes of mixed load with random cancellations and
one pod restart, against a P/D stack it starts (benchmarks/soak_stack.py).

    pdserve bench soak --minutes 30 --json-out soak.json

Clients (the openai package, --concurrency threads) send completions in a
loop: a prompt from a fixed pool of --prompts, greedy with max_tokens drawn
from --max-tokens, streamed or not; --cancel-fraction of the streamed ones
are closed by the client after a random number of chunks. At --restart-at
(a fraction of the run) one decode pod gets --restart-signal, and is started
again on the same ports (a new generation) once it has exited.

Each request ends as one of:
    ok          finished; its tokens are compared with the first ok answer to
                the same prompt and max_tokens (greedy: they must be equal,
                else it counts as `mismatch`)
    cancelled   closed by the client on purpose
    error:KIND  a clear error from the router (KIND: the HTTP status, or the
                error event of a stream that had started)
    lost        the connection broke without an answer, or a stream ended
                without a finish reason
    hung        no answer within --request-timeout (client side)

The report (printed, and written to --json-out) gives the counts (and why
requests were lost), p50/p99
TTFT and end-to-end latency of the ok requests, the RSS of every process
after --warm-up and at the end (the restarted pod's two processes are not
comparable and are left out of the growth target), and each pod's free KV
blocks before and after the load, and `rss_timeline`: every process's RSS
every --rss-interval seconds (does growth level off?), and `error_messages`:
each distinct error text (ids masked) with its count and the first and last
second it was seen, so a long run's errors can be told apart afterwards
(--keep-logs DIR keeps every process's log too). Target: no error, lost,
hung or mismatched request, every process's RSS flat (growth under 2%)
over the last --flat-window seconds (`rss_flat`: a pod's KV cache pages are
first touched as the load fills it, so growth from warm-up is reported but
not judged), every block free at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from benchmarks.soak_stack import SoakStack, kv_blocks, rss_bytes, start_soak_stack

HELP = ("Soak: minutes of mixed load with random cancellations and one decode pod "
        "restart; counts outcomes, latencies, RSS and free blocks (target: nothing lost)")
RSS_FLAT_TARGET = 0.02  # growth over the flat window (issue 40: the last 20 minutes)
SERVED_NAME = "soak"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model dir (default: built-in tiny)")
    parser.add_argument("--minutes", type=float, default=10.0, help="load duration")
    parser.add_argument("--warm-up", type=float, default=None, metavar="SECONDS",
                        help="when start RSS is sampled (default: 10%% of the run, <= 60 s)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--decode-pods", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=24, help="size of the prompt pool")
    parser.add_argument("--max-tokens", default="4,64", metavar="LOW,HIGH")
    parser.add_argument("--stream-fraction", type=float, default=0.8)
    parser.add_argument("--cancel-fraction", type=float, default=0.2,
                        help="of streamed requests, closed early by the client")
    parser.add_argument("--restart-at", type=float, default=0.5, metavar="FRACTION",
                        help="when the decode pod restarts, as a fraction of the run "
                             "(negative: no restart)")
    parser.add_argument("--restart-signal", choices=("term", "kill"), default="kill")
    parser.add_argument("--request-timeout", type=float, default=60.0, metavar="SECONDS")
    parser.add_argument("--pod-arg", action="append", default=[], metavar="ARG",
                        help="extra flag for every pod (repeatable), "
                             "e.g. --pod-arg=--num-blocks=512")
    parser.add_argument("--router-arg", action="append", default=[], metavar="ARG")
    parser.add_argument("--rss-interval", type=float, default=30.0, metavar="SECONDS",
                        help="how often every process's RSS is sampled for the report's "
                             "rss_timeline")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", default=None, metavar="PATH")
    parser.add_argument("--flat-window", type=float, default=None, metavar="SECONDS",
                        help="the RSS must be flat over the last SECONDS of the load "
                             "(default: 20 minutes, at most 2/3 of the run)")
    parser.add_argument("--keep-logs", default=None, metavar="DIR",
                        help="copy every process's log into DIR at the end")


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    lo, hi = int(low), int(high or low)
    if not 1 <= lo <= hi:
        raise ValueError(f"--max-tokens must be LOW,HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return lo, hi


# Request ids and hex digests in error texts, masked so equal errors group.
_IDS = re.compile(r"\b(?:[0-9a-f]{16,}|[0-9a-f-]{36})\b")
_MAX_MESSAGES = 50  # distinct error texts kept; the rest count under "(other)"


class Ledger:
    """Outcomes and latencies from every client thread (thread-safe)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.error_messages: dict[str, dict] = {}
        self.outcomes: Counter[str] = Counter()
        self.ttft_s: list[float] = []
        self.e2e_s: list[float] = []
        self.first_answer: dict[tuple[int, int], str] = {}
        self.lost_why: Counter[str] = Counter()
        self._lock = threading.Lock()

    def error(self, outcome: str, message: str) -> None:
        """Count `outcome` and remember `message` (ids masked) with when it
        was first and last seen, seconds from the start of the load."""
        text = f"{outcome}: {_IDS.sub('<id>', message)[:300]}"
        now = round(time.monotonic() - self.started, 1)
        with self._lock:
            if text not in self.error_messages and len(self.error_messages) >= _MAX_MESSAGES:
                text = f"{outcome}: (other)"
            seen = self.error_messages.setdefault(text, {"count": 0, "first_s": now})
            seen["count"] += 1
            seen["last_s"] = now
        self.record(outcome)

    def record(self, outcome: str, key: tuple[int, int] | None = None, text: str = "",
               ttft: float | None = None, e2e: float | None = None, why: str = "") -> None:
        with self._lock:
            if why:
                self.lost_why[why] += 1
            if outcome == "ok" and key is not None:
                if self.first_answer.setdefault(key, text) != text:
                    outcome = "mismatch"
                else:
                    self.e2e_s.append(e2e or 0.0)
                    if ttft is not None:
                        self.ttft_s.append(ttft)
            self.outcomes[outcome] += 1


def _one_request(client, model: str, prompts: list[str], rng: random.Random,
                 args: argparse.Namespace, ledger: Ledger) -> None:
    import openai

    low, high = _range(args.max_tokens)
    index, max_tokens = rng.randrange(len(prompts)), rng.randint(low, high)
    stream = rng.random() < args.stream_fraction
    cancel_after = (rng.randint(1, max(1, max_tokens // 2))
                    if stream and rng.random() < args.cancel_fraction else None)
    started, ttft, pieces = time.monotonic(), None, []
    body = dict(model=model, prompt=prompts[index], max_tokens=max_tokens, temperature=0,
                extra_body={"ignore_eos": True})
    try:
        if not stream:
            reply = client.completions.create(**body)
            finish, pieces = reply.choices[0].finish_reason, [reply.choices[0].text]
        else:
            finish, chunks = None, 0
            response = client.completions.create(**body, stream=True)
            for chunk in response:
                ttft = ttft if ttft is not None else time.monotonic() - started
                chunks += 1
                if chunk.choices:
                    pieces.append(chunk.choices[0].text)
                    finish = chunk.choices[0].finish_reason or finish
                if cancel_after is not None and chunks >= cancel_after and finish is None:
                    response.close()
                    ledger.record("cancelled")
                    return
    except openai.APITimeoutError:
        ledger.record("hung")
        return
    except openai.APIStatusError as exc:
        ledger.error(f"error:{exc.status_code}", str(exc))
        return
    except openai.APIConnectionError as exc:
        ledger.record("lost", why=type(exc).__name__)
        return
    except openai.APIError as exc:  # an error event inside a started stream
        ledger.error(f"error:stream:{type(exc).__name__}", str(exc))
        return
    except Exception as exc:  # noqa: BLE001 - e.g. the connection broke mid-stream (httpx)
        ledger.record("lost", why=type(exc).__name__)
        return
    if finish is None:
        ledger.record("lost", why="no finish_reason")
        return
    ledger.record("ok", (index, max_tokens), "".join(pieces), ttft,
                  time.monotonic() - started)


def _clients(url: str, model: str, args: argparse.Namespace, ledger: Ledger,
             stop: threading.Event) -> list[threading.Thread]:
    import openai

    words = random.Random(args.seed)
    prompts = [" ".join(f"w{words.randrange(500)}" for _ in range(words.randint(8, 120)))
               for _ in range(args.prompts)]

    def run(seed: int) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="soak",
                               timeout=args.request_timeout, max_retries=0)
        rng = random.Random(seed)
        while not stop.is_set():
            _one_request(client, model, prompts, rng, args, ledger)

    return [threading.Thread(target=run, args=(args.seed * 1000 + i,), daemon=True)
            for i in range(args.concurrency)]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] * 1e3, 1)


def _snapshot_rss(stack: SoakStack) -> dict[str, int]:
    return {name: rss_bytes(c.process.pid) for name, c in stack.children.items()
            if c.process is not None}


def _wait_idle(stack: SoakStack, timeout: float = 30) -> dict[str, tuple[int, int]]:
    """Each pod's (free, total) blocks, once all are free or at `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        blocks = {c.name: kv_blocks(c) for c in stack.pods}
        if all(f == t for f, t in blocks.values()) or time.monotonic() > deadline:
            return blocks
        time.sleep(0.1)


class RssTimeline:
    """Every process's RSS (MiB) every `interval` seconds while the load runs,
    so a report shows whether growth levels off or keeps going."""

    def __init__(self, stack: SoakStack, interval: float, started: float) -> None:
        self.samples: list[dict] = []
        self._stack, self._interval, self._started = stack, interval, started
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-rss", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(5)
        return self.samples

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            rss = _snapshot_rss(self._stack)
            self.samples.append({"t_s": round(time.monotonic() - self._started, 1),
                                 **{name: round(b / 2**20, 1) for name, b in rss.items()}})


def run_soak(stack: SoakStack, args: argparse.Namespace) -> dict:
    """Drive the load against a started stack; returns the report."""
    duration = args.minutes * 60
    warm_up = args.warm_up if args.warm_up is not None else min(60.0, duration / 10)
    blocks_start = _wait_idle(stack)
    ledger, stop = Ledger(), threading.Event()
    threads = _clients(stack.http_url, SERVED_NAME, args, ledger, stop)
    started = time.monotonic()
    timeline = RssTimeline(stack, args.rss_interval, started)
    for thread in threads:
        thread.start()
    timeline.start()
    time.sleep(warm_up)
    rss_start = _snapshot_rss(stack)
    restart = None
    if args.restart_at >= 0:
        time.sleep(max(0.0, started + args.restart_at * duration - time.monotonic()))
        sig = signal.SIGKILL if args.restart_signal == "kill" else signal.SIGTERM
        restart = {"pod": "decode0", "signal": args.restart_signal,
                   "at_s": round(time.monotonic() - started, 1),
                   "back_after_s": round(stack.restart("decode0", sig), 2)}
    time.sleep(max(0.0, started + duration - time.monotonic()))
    stop.set()
    for thread in threads:
        thread.join(args.request_timeout + 10)
    unfinished = sum(t.is_alive() for t in threads)
    rss_end = _snapshot_rss(stack)
    samples = timeline.stop()
    blocks_end = _wait_idle(stack)
    report = _report(ledger, unfinished, time.monotonic() - started, warm_up, restart,
                     rss_start, rss_end, blocks_start, blocks_end)
    window = args.flat_window if args.flat_window is not None else min(1200.0, duration * 2 / 3)
    report["rss_flat"] = _flat_window(samples, window, restart)
    report["target_met"] = report["target_met"] and all(
        r["growth"] < RSS_FLAT_TARGET for r in report["rss_flat"].values()
        if r["growth"] is not None)
    report["rss_timeline"] = samples
    return report


def _flat_window(samples: list[dict], window: float, restart: dict | None) -> dict:
    """Each process's RSS growth from the first sample of the last `window`
    seconds to the last sample; None for a pod restarted inside the window
    (its two processes are not comparable) or without two samples."""
    if len(samples) < 2:
        return {}
    since = samples[-1]["t_s"] - window
    first = next(sample for sample in samples if sample["t_s"] >= since)
    last = samples[-1]
    flat = {}
    for name in (n for n in last if n != "t_s"):
        restarted = (restart is not None and restart["pod"] == name
                     and restart["at_s"] >= first["t_s"])
        start, end = first.get(name), last[name]
        flat[name] = {"from_s": first["t_s"], "start_mib": start, "end_mib": end,
                      "growth": None if restarted or not start or first is last
                      else round(end / start - 1, 4)}
    return flat


def _report(ledger: Ledger, unfinished: int, seconds: float, warm_up: float,
            restart: dict | None, rss_start: dict[str, int], rss_end: dict[str, int],
            blocks_start: dict, blocks_end: dict) -> dict:
    outcomes = dict(ledger.outcomes)
    if unfinished:
        outcomes["hung"] = outcomes.get("hung", 0) + unfinished
    rss = {}
    for name, start in rss_start.items():
        end = rss_end.get(name, 0)
        restarted = restart is not None and restart["pod"] == name
        rss[name] = {"start_mib": round(start / 2**20, 1), "end_mib": round(end / 2**20, 1),
                     "growth": None if restarted or not start else round(end / start - 1, 4)}
    growths = [r["growth"] for r in rss.values() if r["growth"] is not None]
    blocks = {name: {"free_start": blocks_start[name][0], "free_end": free,
                     "total": total} for name, (free, total) in blocks_end.items()}
    bad = sum(v for k, v in outcomes.items()
              if k in ("lost", "hung", "mismatch") or k.startswith("error:"))
    return {
        "duration_s": round(seconds, 1), "warm_up_s": warm_up,
        "requests": {"total": sum(outcomes.values()), "served": outcomes.get("ok", 0),
                     "cancelled": outcomes.get("cancelled", 0),
                     "lost": outcomes.get("lost", 0), "lost_why": dict(ledger.lost_why),
                     "hung": outcomes.get("hung", 0),
                     "mismatch": outcomes.get("mismatch", 0),
                     "errors": {k: v for k, v in outcomes.items() if k.startswith("error:")}},
        "error_messages": dict(sorted(ledger.error_messages.items(),
                                      key=lambda item: -item[1]["count"])),
        "latency_ms": {"ttft_p50": _percentile(ledger.ttft_s, 50),
                       "ttft_p99": _percentile(ledger.ttft_s, 99),
                       "e2e_p50": _percentile(ledger.e2e_s, 50),
                       "e2e_p99": _percentile(ledger.e2e_s, 99)},
        "rss": rss, "max_rss_growth": max(growths) if growths else None,
        "kv_blocks": blocks, "restart": restart,
        "target_met": bad == 0 and all(b["free_end"] == b["total"] for b in blocks.values()),
    }


def _keep_logs(stack: SoakStack, into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    for child in stack.children.values():
        if child.log.exists():
            shutil.copy(child.log, into / child.log.name)


def main(args: argparse.Namespace) -> int:
    try:
        _range(args.max_tokens)
        import openai  # noqa: F401 - the clients need it
    except (ValueError, ImportError) as exc:
        print(f"pdserve bench soak: {exc}", file=sys.stderr)
        return 2
    from engine.make_model import ensure_model

    model = Path(args.model) if args.model else ensure_model("tiny")
    with tempfile.TemporaryDirectory(prefix="pdserve-soak-") as tmp:
        stack = start_soak_stack(model, Path(tmp), num_decode=args.decode_pods,
                                 pod_args=args.pod_arg,
                                 router_args=["--served-model-name", SERVED_NAME,
                                              *args.router_arg])
        try:
            report = run_soak(stack, args)
        finally:
            stack.stop()
            if args.keep_logs:
                _keep_logs(stack, Path(args.keep_logs))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return 0 if report["target_met"] else 1
