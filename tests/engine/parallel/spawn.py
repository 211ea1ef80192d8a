"""Helpers for the tensor-parallel tests: run a function on N real rank
processes (spawned, one gloo `TPGroup` whose rendezvous store the calling
process hosts on a loopback port it has bound), write a
checkpoint from a raw config, and run a model over a small paged batch the
way the engine does (one prefill step of whole prompts, then one
pure-decode step), returning its logits and KV cache.

The functions handed to `run_ranks` live here so that a spawned child can
import them by name (`tests.engine.parallel.spawn`).
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

from engine.kv_cache import allocate_kv_caches
from engine.layer_attention import layer_attention
from engine.layers.linear import prepack, resolve_backend, resolve_decode_matmul
from engine.loader import load_model
from engine.make_model import ModelSpec, build_weights
from engine.model_config import ModelConfig
from engine.paged_attention_context import PagedAttentionContext, PrefillChunk
from engine.parallel.group import TPGroup, host_store, join_store

BLOCK_SIZE = 16
RANK_TIMEOUT_S = 60.0  # every collective and the rendezvous


def _rank_main(target: Callable[..., Any], rank: int, size: int, init_method: str,
               out_dir: str, args: tuple[Any, ...]) -> None:
    out = Path(out_dir)
    try:
        torch.set_num_threads(1)  # N ranks share this machine's few cores
        store = join_store(init_method, RANK_TIMEOUT_S)
        group = TPGroup.initialize(rank=rank, size=size, store=store,
                                   device="cpu", timeout_s=RANK_TIMEOUT_S)
        try:
            result = target(group, *args)
        finally:
            group.destroy()
        torch.save(result, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def run_ranks(target: Callable[..., Any], size: int, *args: Any, tmp_dir: Path,
              timeout_s: float = 120.0) -> list[Any]:
    """`target(group, *args)` on ranks 0..size-1, each its own spawned
    process; each rank's return value (through torch.save in `tmp_dir`), in
    rank order. A rank that fails fails the call with its traceback; one
    still running after `timeout_s` is killed."""
    tmp_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    _store, init_method = host_store(RANK_TIMEOUT_S)  # every rank joins it as a client
    procs = [ctx.Process(target=_rank_main,
                         args=(target, rank, size, init_method, str(tmp_dir), args))
             for rank in range(size)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout_s)
    hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for rank in hung:
        procs[rank].kill()
        procs[rank].join()
    errors = [(tmp_dir / f"rank{r}.err").read_text() for r in range(size)
              if (tmp_dir / f"rank{r}.err").exists()]
    if errors or hung:
        raise AssertionError(f"ranks hung: {hung}; failures:\n" + "\n".join(errors))
    codes = [proc.exitcode for proc in procs]
    assert codes == [0] * size, f"rank exit codes {codes}"
    return [torch.load(tmp_dir / f"rank{r}.pt", weights_only=False) for r in range(size)]


def write_checkpoint(out_dir: Path, raw_config: dict[str, Any], seed: int = 0) -> Path:
    """config.json and model.safetensors (make-model's random init) for an
    HF config dict, for shapes `make_model` does not write (Gemma, an odd
    vocabulary, partial rotary). No tokenizer: the tests feed token ids."""
    out_dir.mkdir(parents=True)
    config = ModelConfig.from_dict(raw_config, source=str(out_dir / "config.json"))
    save_file(build_weights(ModelSpec(seed=seed), config), str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(raw_config, indent=2))
    return out_dir


def vocab_of(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def prompts_for(vocab_size: int, lengths: tuple[int, ...] = (7, 20, 37),
                seed: int = 0) -> list[list[int]]:
    """Token ids over the whole vocabulary (every rank's range, the last id
    and 0 included)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]
    prompts[0][:2] = [0, vocab_size - 1]
    return prompts


def load_prepacked(model_dir: Path, tp: TPGroup | None = None):
    """The model as the engine runs it: loaded (this rank's shard under
    `tp`) and its linears packed for the CPU backend `auto` picks."""
    model, _ = load_model(model_dir, dtype="float32", device="cpu", tp=tp)
    backend = resolve_backend("auto", model.dtype, model.device)
    prepack(model, backend, resolve_decode_matmul("auto", model.dtype, model.device, backend))
    return model


def _slots(tables: list[list[int]], rows: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor([tables[seq][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
                         for seq, pos in rows], dtype=torch.int64)


@torch.inference_mode()
def paged_forward(model, prompts: list[list[int]]) -> dict[str, Any]:
    """Step 1 prefills every prompt whole (one batch), step 2 decodes one
    fixed token per sequence (the fused decode path). Returns the float32
    logits of every row of each step (None off rank 0 under tensor
    parallelism), the KV cache per layer [2, blocks, block, local KV heads,
    head_dim], the layout and the model's parameter count (this rank's)."""
    config = model.config
    per_seq = [-(-(len(p) + 1) // BLOCK_SIZE) for p in prompts]
    tables = [list(range(sum(per_seq[:i]), sum(per_seq[:i + 1]))) for i in range(len(prompts))]
    caches = allocate_kv_caches(
        num_layers=config.num_hidden_layers, num_blocks=sum(per_seq), block_size=BLOCK_SIZE,
        num_kv_heads=model.shard.num_kv_heads, head_dim=config.head_dim, dtype=model.dtype,
        device=model.device)
    common = dict(kv_caches=caches, scale=config.head_dim ** -0.5,
                  sliding_window=config.sliding_window, layers=layer_attention(config),
                  kernel_backend=model.kernel_backend)
    rows = [(seq, pos) for seq, p in enumerate(prompts) for pos in range(len(p))]
    starts = [sum(map(len, prompts[:i])) for i in range(len(prompts))]
    prefill_ctx = PagedAttentionContext(
        slot_mapping=_slots(tables, rows), num_decode=0,
        decode_block_tables=torch.zeros((0, max(per_seq)), dtype=torch.int32),
        decode_context_lens=torch.zeros(0, dtype=torch.int32),
        prefill_chunks=tuple(PrefillChunk(s, len(p), -1, len(p))
                             for s, p in zip(starts, prompts, strict=True)),
        prefill_context_slots=None, **common)
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64)
    positions = torch.tensor([pos for _, pos in rows], dtype=torch.int64)
    prefill = model.compute_logits(model(ids, positions, prefill_ctx))

    decode_rows = [(seq, len(p)) for seq, p in enumerate(prompts)]
    table = torch.zeros((len(prompts), max(per_seq)), dtype=torch.int32)
    for seq, blocks in enumerate(tables):
        table[seq, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    decode_ctx = PagedAttentionContext(
        slot_mapping=_slots(tables, decode_rows), num_decode=len(prompts),
        decode_block_tables=table,
        decode_context_lens=torch.tensor([len(p) + 1 for p in prompts], dtype=torch.int32),
        prefill_chunks=(), prefill_context_slots=None, **common)
    next_ids = torch.tensor([p[-1] for p in prompts], dtype=torch.int64)  # any fixed tokens
    decode_positions = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
    decode = model.compute_logits(model(next_ids, decode_positions, decode_ctx))
    return dict(prefill=prefill, decode=decode, kv=[c.clone() for c in caches],
                shard=model.shard, num_params=sum(p.numel() for p in model.parameters()))


def sharded_forward(group: TPGroup, model_dirs: list[str],
                    prompts: list[list[list[int]]]) -> list[dict[str, Any]]:
    """Rank target: `paged_forward` of each model (this rank's shard)."""
    return [paged_forward(load_prepacked(Path(d), group), p)
            for d, p in zip(model_dirs, prompts, strict=True)]


def group_ops(group: TPGroup) -> dict[str, Any]:
    """Rank target: each `TPGroup` collective once, on values that name
    their rank (the test knows what each must give)."""
    shard = 5
    local = (torch.arange(shard) + group.rank * shard).repeat(3, 1).to(torch.bfloat16)
    return dict(
        all_reduce=group.all_reduce(torch.tensor([group.rank + 1.0, 10.0 * (group.rank + 1)])),
        # the last shard has 2 padding columns
        gathered=group.gather_logits(local, vocab_size=shard * group.size - 2),
        broadcast=group.broadcast_from_first(torch.full((4,), float(group.rank + 7))),
        min_int=group.min_int(100 - 7 * group.rank),
    )
