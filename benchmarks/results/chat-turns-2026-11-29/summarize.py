"""Tables of the chat-turns runs: python summarize.py json/*.json

Per run: later turns' (turn >= 1) TTFT p50/p90/p99 and the share of their
prompt tokens served as cache hits (usage cached_tokens), every request's
ITL p50/p99, output tok/s, and the KV bytes the prefill pod sent."""

import json
import sys


def pct(values, q):
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


print("| run | later turns' TTFT p50 / p90 / p99 ms | cached / prompt (later turns) "
      "| ITL p50 / p99 ms | output tok/s | KV sent MB |")
print("|---|---|---:|---|---:|---:|")
for path in sys.argv[1:]:
    d = json.load(open(path))
    later = [r for r in d["requests"] if r["turn"] >= 1 and r["error"] is None]
    ttft = [r["ttft_s"] * 1000 for r in later]
    cached = sum(r["cached_tokens"] for r in later) / sum(r["prompt_len"] for r in later)
    sent = (d.get("server_metrics") or {}).get("kv_bytes_sent")
    print(f"| {d['label']} | {pct(ttft, 50):.0f} / {pct(ttft, 90):.0f} / {pct(ttft, 99):.0f} "
          f"| {cached:.3f} | {d['itl_ms']['p50']:.1f} / {d['itl_ms']['p99']:.1f} "
          f"| {d['output_throughput']:.1f} | {sent / 1e6 if sent else float('nan'):.0f} |")
