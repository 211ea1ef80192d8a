"""`pdserve trace REQUEST_ID`: one finished request's timeline, without a tracing backend.

Reads the router's `GET /debug/requests/{id}` (telemetry/history.py, kept
for the last --trace-history requests) and prints its phases as a table:
phase, start offset and duration in ms, details; then the attempts (pods,
path, KV bytes, failure) and events (first token, retries, migrations).
`--json` prints the endpoint's JSON as it came. docs/tracing.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request

HELP = "Print one finished request's timeline from the router (GET /debug/requests/{id})."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("request_id", metavar="REQUEST_ID",
                        help="the response's id (chatcmpl-<id>, cmpl-<id>) or the bare id")
    parser.add_argument("--router", default="http://127.0.0.1:8000", metavar="URL",
                        help="the router's HTTP address, or its API base URL .../v1 "
                             "(default %(default)s)")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="the key the request was made with (default: PDSERVE_API_KEY)")
    parser.add_argument("--json", action="store_true", help="print the timeline as JSON")
    parser.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS")


def fetch(router: str, request_id: str, api_key: str | None, timeout: float) -> dict:
    """The router's timeline JSON; raises RuntimeError with the router's message."""
    base = router.rstrip("/").removesuffix("/v1")  # the API's base URL works too
    url = f"{base}/debug/requests/{urllib.parse.quote(request_id, safe='')}"
    request = urllib.request.Request(url)
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise RuntimeError(f"{url}: HTTP {exc.code}: {message}") from None
    except urllib.error.URLError as exc:
        raise RuntimeError(f"cannot reach the router at {router}: {exc.reason}") from None


def render(timeline: dict) -> str:
    """The timeline as a readable table."""
    head = {k: v for k, v in timeline.items() if k not in ("phases", "events", "attempts")}
    lines = [f"request {timeline['id']}: {timeline.get('outcome')} in "
             f"{timeline.get('duration_ms', 0):.1f} ms"]
    lines += [f"  {k}: {v}" for k, v in head.items()
              if k not in ("id", "outcome", "duration_ms") and v is not None]
    lines.append("")
    lines.append(f"{'phase':<20} {'start ms':>10} {'duration ms':>12}  details")
    for phase in timeline.get("phases", ()):
        lines.append(f"{phase['phase']:<20} {phase['start_ms']:>10.1f} "
                     f"{phase['duration_ms']:>12.1f}  {_details(phase.get('details'))}")
    if timeline.get("attempts"):
        lines.append("")
        lines.append("attempts:")
        lines += [f"  {_details(attempt)}" for attempt in timeline["attempts"]]
    if timeline.get("events"):
        lines.append("")
        lines.append(f"{'event':<20} {'at ms':>10}  details")
        lines += [f"{e['event']:<20} {e['at_ms']:>10.1f}  {_details(e.get('details'))}"
                  for e in timeline["events"]]
    return "\n".join(lines)


def _details(details: dict | None) -> str:
    return " ".join(f"{k}={v}" for k, v in (details or {}).items() if v is not None)


def main(args: argparse.Namespace) -> int:
    api_key = args.api_key or os.environ.get("PDSERVE_API_KEY") or None
    try:
        timeline = fetch(args.router, args.request_id, api_key, args.timeout)
    except RuntimeError as exc:
        print(f"pdserve trace: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(timeline, indent=2) if args.json else render(timeline))
    return 0
