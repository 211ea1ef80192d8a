"""Ahead-of-time compilation of every kernel variant for real GPUs, without one.

Each kernel module lists the variants its launcher can pick (`all_*_configs`,
built from the same selection function the launcher calls); this module
turns each into a `KernelSpec` (the jit function, a typed signature and the
constexpr values), compiles it with `triton.compile` for a CUDA target
(sm_80 and sm_90 here: A100, H100/H200) and reports the resources ptxas
assigned: registers, shared memory, and spill bytes.

Callers: `tests/kernels/test_aot.py`, which runs `python -m kernels.aot
--json` in a subprocess with TRITON_INTERPRET=0 (a representative subset
by default, every variant with PDSERVE_AOT_ALL=1), and docs/kernels.md's
table, produced by `python -m kernels.aot --all`. Runs on CPU-only
machines: Triton ships ptxas in its wheel; no driver is touched.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

from kernels import kv_copy, norm, paged_attention, prefill_attention, rotary
from kernels.checks import HEAD_DIMS

CAPABILITIES = (80, 90)
_PTR = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16"}


@dataclass(frozen=True, slots=True)
class KernelSpec:
    """One compiled variant: what the launcher would launch for `label`."""

    label: str
    fn: Any  # triton.runtime.jit.JITFunction
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int
    attrs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = set(self.fn.arg_names) - set(self.signature)
        if missing:
            raise ValueError(f"{self.label}: signature lacks arguments {sorted(missing)}")


@dataclass(frozen=True, slots=True)
class CompileReport:
    label: str
    capability: int
    registers: int
    shared_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int


def decode_specs(config: paged_attention.DecodeAttentionConfig) -> list[KernelSpec]:
    """The partial kernel of `config` (the reduce kernel is listed by `reduce_specs`)."""
    ptr = _PTR[config.dtype]
    ints = ("partition_size", "group", "stride_qb", "stride_qh", "stride_kb",
            "stride_kt", "stride_kh", "stride_bt", "stride_pb", "stride_ph", "stride_ps")
    signature = {
        "q_ptr": ptr, "k_ptr": ptr, "v_ptr": ptr, "block_tables_ptr": "*i32",
        "context_lens_ptr": "*i32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
        "scale_log2": "fp32", "sliding_window": "i32", "softcap_log2": "fp32",
        **dict.fromkeys(ints, "i32"),
        **dict.fromkeys(("HEAD_DIM", "BLOCK_D", "BLOCK_SIZE", "GROUP_PAD", "HEAD_SLICES",
                         "TILE_N", "DOT_FP32", "SOFTCAP"), "constexpr"),
    }
    constexprs = {
        "HEAD_DIM": config.head_dim, "BLOCK_D": config.block_d, "BLOCK_SIZE": config.block_size,
        "GROUP_PAD": config.group_pad, "HEAD_SLICES": config.head_slices,
        "TILE_N": config.tile_n,
        # What the launcher passes on a GPU (the interpreter-only bf16 case is off).
        "DOT_FP32": config.dtype == "fp32",
        # The soft-capped variant (Gemma 2) is compiled when first used.
        "SOFTCAP": False,
    }
    label = (f"decode {config.dtype} D={config.head_dim} bs={config.block_size} "
             f"group<={config.group_pad}{_sliced(config.head_slices)} tile={config.tile_n}")
    return [KernelSpec(label, paged_attention._decode_partial_kernel, signature, constexprs,
                       config.num_warps)]


def prefill_specs(config: prefill_attention.PrefillAttentionConfig) -> list[KernelSpec]:
    ptr = _PTR[config.dtype]
    ints = ("group", "stride_qt", "stride_qh", "stride_ot", "stride_oh",
            "stride_kb", "stride_kt", "stride_kh", "stride_bt")
    signature = {
        "q_ptr": ptr, "k_ptr": ptr, "v_ptr": ptr, "out_ptr": ptr, "block_tables_ptr": "*i32",
        "query_start_ptr": "*i32", "context_lens_ptr": "*i32", "tile_seq_ptr": "*i32",
        "tile_start_ptr": "*i32", "scale_log2": "fp32", "sliding_window": "i32",
        "softcap_log2": "fp32", **dict.fromkeys(ints, "i32"),
        **dict.fromkeys(("HEAD_DIM", "BLOCK_D", "BLOCK_SIZE", "GROUP_PAD", "HEAD_SLICES",
                         "BLOCK_M", "TILE_N", "DOT_FP32", "SOFTCAP"), "constexpr"),
    }
    constexprs = {
        "HEAD_DIM": config.head_dim, "BLOCK_D": config.block_d, "BLOCK_SIZE": config.block_size,
        "GROUP_PAD": config.group_pad, "HEAD_SLICES": config.head_slices,
        "BLOCK_M": config.block_m, "TILE_N": config.tile_n,
        "DOT_FP32": config.dtype == "fp32", "SOFTCAP": False,
    }
    label = (f"prefill {config.dtype} D={config.head_dim} bs={config.block_size} "
             f"group<={config.group_pad}{_sliced(config.head_slices)} tile={config.tile_n}")
    return [KernelSpec(label, prefill_attention._prefill_kernel, signature, constexprs,
                       config.num_warps)]


def _sliced(head_slices: int) -> str:
    # A sliced group (head_slices programs per KV head) is its own variant.
    return f"x{head_slices}" if head_slices > 1 else ""


def reduce_specs() -> list[KernelSpec]:
    specs = []
    for dtype in ("fp32", "fp16", "bf16"):
        for head_dim in HEAD_DIMS:
            signature = {
                "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": _PTR[dtype],
                "num_splits": "i32", "stride_pb": "i32", "stride_ph": "i32",
                "stride_ob": "i32", "stride_oh": "i32",
                "HEAD_DIM": "constexpr", "BLOCK_D": "constexpr", "SPLITS_PAD": "constexpr",
            }
            constexprs = {"HEAD_DIM": head_dim,
                          "BLOCK_D": paged_attention.padded_head_dim(head_dim),
                          "SPLITS_PAD": paged_attention.MAX_SPLITS}
            specs.append(KernelSpec(f"decode-reduce {dtype} D={head_dim}",
                                    paged_attention._decode_reduce_kernel, signature,
                                    constexprs, 4))
    return specs


def copy_specs(config: kv_copy.CopyConfig) -> list[KernelSpec]:
    ptr = f"*i{config.bits}"
    inject = {
        "k_cache_ptr": ptr, "v_cache_ptr": ptr, "src_ptr": ptr, "slot_mapping_ptr": "*i64",
        "num_slots": "i32", "row": "i32", "stride_src_kv": "i32", "stride_src_t": "i32",
        "CHUNK": "constexpr",
    }
    extract = {
        "k_cache_ptr": ptr, "v_cache_ptr": ptr, "out_k_ptr": ptr, "out_v_ptr": ptr,
        "slot_mapping_ptr": "*i64", "num_slots": "i32", "row": "i32", "CHUNK": "constexpr",
    }
    constexprs = {"CHUNK": config.chunk}
    suffix = f"{config.bits}-bit chunk={config.chunk}"
    return [
        KernelSpec(f"inject {suffix}", kv_copy._inject_kernel, inject, constexprs, 4),
        KernelSpec(f"extract {suffix}", kv_copy._extract_kernel, extract, constexprs, 4),
    ]


def rms_norm_specs(config: norm.RmsNormConfig) -> list[KernelSpec]:
    ptr = _PTR[config.dtype]
    signature = {
        "x_ptr": ptr, "residual_ptr": ptr, "weight_ptr": _PTR[config.weight_dtype],
        "y_ptr": ptr, "r_out_ptr": ptr, "hidden": "i32", "eps": "fp32",
        "stride_x": "i32", "stride_residual": "i32", "stride_y": "i32", "stride_r_out": "i32",
        "BLOCK_H": "constexpr", "HAS_RESIDUAL": "constexpr",
    }
    constexprs = {"BLOCK_H": config.block_h, "HAS_RESIDUAL": config.has_residual}
    label = (f"rms_norm {config.dtype} w={config.weight_dtype} H<={config.block_h}"
             f"{' +residual' if config.has_residual else ''}")
    return [KernelSpec(label, norm._rms_norm_kernel, signature, constexprs, config.num_warps)]


def rotary_specs(config: rotary.RotaryConfig) -> list[KernelSpec]:
    ptr = _PTR[config.dtype]
    signature = {
        "positions_ptr": "*i64", "x_ptr": ptr, "out_ptr": ptr, "cos_sin_ptr": "*fp32",
        "num_heads": "i32", "stride_xt": "i32", "stride_xh": "i32", "stride_ot": "i32",
        "stride_oh": "i32", "HALF": "constexpr", "HALF_PAD": "constexpr",
        "HEADS_TILE": "constexpr",
    }
    constexprs = {"HALF": config.head_dim // 2, "HALF_PAD": config.half_pad,
                  "HEADS_TILE": rotary.HEADS_TILE}
    return [KernelSpec(f"rope {config.dtype} D={config.head_dim}", rotary._rotary_kernel,
                       signature, constexprs, 4)]


def all_specs() -> list[KernelSpec]:
    """Every variant any launcher can pick."""
    specs = [s for c in paged_attention.all_decode_configs() for s in decode_specs(c)]
    specs += reduce_specs()
    specs += [s for c in prefill_attention.all_prefill_configs() for s in prefill_specs(c)]
    specs += [s for c in kv_copy.all_copy_configs() for s in copy_specs(c)]
    specs += [s for c in norm.all_rms_norm_configs() for s in rms_norm_specs(c)]
    specs += [s for c in rotary.all_rotary_configs() for s in rotary_specs(c)]
    return specs


def representative_specs() -> list[KernelSpec]:
    """A subset covering every value of every axis at least once (the default test run)."""
    import torch

    decode = [
        paged_attention.decode_config(dtype, head_dim, block_size, group)
        for dtype, head_dim, block_size, group in (
            (torch.float16, 128, 16, 8), (torch.bfloat16, 128, 128, 4),
            (torch.float32, 128, 256, 1), (torch.bfloat16, 64, 32, 32),
            (torch.float16, 64, 64, 64), (torch.float32, 64, 128, 8),
            (torch.float16, 96, 16, 4), (torch.float32, 96, 64, 40),
            (torch.bfloat16, 256, 16, 2), (torch.float16, 256, 128, 64),
            (torch.float32, 256, 32, 8), (torch.float32, 256, 16, 64),
        )
    ]
    norms = [
        norm.rms_norm_config(torch.bfloat16, torch.bfloat16, 4096, True),
        norm.rms_norm_config(torch.float16, torch.float32, 16384, False),
        norm.rms_norm_config(torch.float32, torch.float32, 200, True),
    ]
    specs = [s for c in decode for s in decode_specs(c)]
    reduces = ("fp16 D=64", "bf16 D=128", "fp32 D=96", "bf16 D=256")
    specs += [s for s in reduce_specs() if s.label.removeprefix("decode-reduce ") in reduces]
    prefills = [
        prefill_attention.prefill_config(dtype, head_dim, block_size, group)
        for dtype, head_dim, block_size, group in (
            (torch.bfloat16, 128, 16, 4), (torch.float16, 128, 256, 8),
            (torch.float32, 64, 128, 1), (torch.bfloat16, 64, 32, 64),
            (torch.bfloat16, 96, 16, 8), (torch.float32, 96, 32, 2),
            (torch.float16, 256, 16, 1), (torch.bfloat16, 256, 64, 40),
            (torch.float32, 256, 16, 4), (torch.float32, 256, 256, 20),
        )
    ]
    specs += [s for c in prefills for s in prefill_specs(c)]
    specs += [s for c in kv_copy.all_copy_configs() for s in copy_specs(c)]
    specs += [s for c in norms for s in rms_norm_specs(c)]
    specs += rotary_specs(rotary.rotary_config(torch.bfloat16, 128))
    specs += rotary_specs(rotary.rotary_config(torch.float16, 96))
    return specs


def compile_spec(spec: KernelSpec, capability: int) -> CompileReport:
    """Compiles for `cuda:capability` and reads ptxas's resource report of the PTX."""
    source = triton.compiler.ASTSource(
        fn=spec.fn, signature=spec.signature, constexprs=spec.constexprs,
        attrs=spec.attrs,
    )
    compiled = triton.compile(
        source, target=GPUTarget("cuda", capability, 32), options={"num_warps": spec.num_warps}
    )
    registers, spill_stores, spill_loads = _ptxas_usage(compiled.asm["ptx"], capability)
    return CompileReport(spec.label, capability, registers, compiled.metadata.shared,
                         spill_stores, spill_loads)


def _ptxas_usage(ptx: str, capability: int) -> tuple[int, int, int]:
    # Triton runs ptxas -v itself but drops the log; running it again on the
    # PTX reports the same allocation (registers and spills) for the report.
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        result = subprocess.run(
            [get_ptxas(capability).path, "-v", f"--gpu-name={sm_arch_from_capability(capability)}",
             str(path), "-o", str(Path(tmp) / "kernel.cubin")],
            capture_output=True, text=True, check=True,
        )
    log = result.stderr + result.stdout
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if registers is None or spills is None:
        raise RuntimeError(f"unexpected ptxas -v output:\n{log}")
    return int(registers.group(1)), int(spills.group(1)), int(spills.group(2))


def main(argv: list[str]) -> int:
    """`python -m kernels.aot [--all] [--only WORD] [--capability N] [--json]`:
    resources, one line per variant (for every target, or sm_N alone).

    Markdown table rows by default, JSON objects with `--json` (what the AOT
    test reads). Must run with TRITON_INTERPRET unset or 0: under the
    interpreter, Triton's front end cannot compile for a GPU target.
    """
    if triton.knobs.runtime.interpret:
        print("kernels.aot compiles for GPUs: run it with TRITON_INTERPRET=0", file=sys.stderr)
        return 2
    specs = all_specs() if "--all" in argv else representative_specs()
    # --only WORD keeps the variants whose label starts with WORD (e.g. prefill).
    if "--only" in argv:
        word = argv[argv.index("--only") + 1]
        specs = [spec for spec in specs if spec.label.startswith(word)]
    capabilities = CAPABILITIES
    if "--capability" in argv:
        wanted = int(argv[argv.index("--capability") + 1])
        if wanted not in CAPABILITIES:
            print(f"--capability must be one of {CAPABILITIES}, got {wanted}", file=sys.stderr)
            return 2
        capabilities = (wanted,)
    as_json = "--json" in argv
    if not as_json:
        print("| kernel | target | registers | shared (B) | spill stores (B) | spill loads (B) |")
        print("|---|---|---|---|---|---|")
    for spec in specs:
        for capability in capabilities:
            r = compile_spec(spec, capability)
            if as_json:
                print(json.dumps(dataclasses.asdict(r)), flush=True)
            else:
                print(f"| {r.label} | sm_{r.capability} | {r.registers} | {r.shared_bytes} | "
                      f"{r.spill_store_bytes} | {r.spill_load_bytes} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
