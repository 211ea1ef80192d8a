"""The peer workload's waves on the engine alone, with the pod's engine
config (`pdserve serve`'s flags as `ab.sh` starts the pod): 8 requests of
256 random prompt tokens, 64 out (greedy, ignore_eos, logprobs 1), one
warm-up wave then four; per wave its time, its first step (the 8
prompts' prefill) and the median of its decode steps.

    PYTHONPATH=REPO python wave.py DTYPE LABEL [extra pdserve serve flags]
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import torch  # noqa: E402

from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model_source import resolve_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.cli import build_parser  # noqa: E402
from pdserve.commands._pod_flags import engine_config_from_args  # noqa: E402

dtype, label = sys.argv[1], sys.argv[2]
argv = ["serve", "--model", str(resolve_model("smollm2-135m-instruct")), "--dtype", dtype,
        "--kv-cache-memory", "2GiB", "--max-num-seqs", "64", "--max-model-len", "2048",
        *sys.argv[3:]]
engine = LLMEngine(engine_config_from_args(build_parser(argv).parse_args(argv)))
gen = torch.Generator().manual_seed(0)
vocab = engine.model_config.vocab_size
params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=1)


def wave(tag: str) -> list[float]:
    for i in range(8):
        engine.add_request(f"{tag}-{i}", torch.randint(10, vocab, (256,), generator=gen).tolist(),
                           params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


wave("warm-up")
waves = [wave(f"w{r}") for r in range(4)]
print(label, dtype, "wave ms", [round(sum(t) * 1e3) for t in waves],
      "first step ms", [round(t[0] * 1e3) for t in waves],
      "decode step median ms", [round(statistics.median(t[4:]) * 1e3, 2) for t in waves])
