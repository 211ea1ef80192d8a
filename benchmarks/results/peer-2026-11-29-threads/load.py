"""The peer workload's load (48 requests of 256 random prompt tokens, 64 out,
8 in flight, tokens counted by logprobs) against a running server, with
fresh prompts each run so no prefix cache helps: what ab.sh runs."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmarks.peer import prompt_vocabulary  # noqa: E402
from benchmarks.serve_client import LoadSpec, random_prompts, run_load  # noqa: E402

url, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 48
model_dir = Path(sys.argv[3] if len(sys.argv) > 3
                 else "~/.cache/pdserve/models/smollm2-135m-instruct").expanduser()
size, specials = prompt_vocabulary(model_dir)
r = run_load(url, model_dir.name, random_prompts(n, 256, size, seed=int(time.time()),
                                                 exclude=specials),
             LoadSpec(max_tokens=64, concurrency=8, seed=0, token_count="logprobs"))
print(n, f"tok/s {r['output_throughput']:.1f}",
      f"itl p50 {r['itl_ms']['p50']:.1f} p99 {r['itl_ms']['p99']:.1f}",
      f"ttft p50 {r['ttft_ms']['p50']:.0f}")
