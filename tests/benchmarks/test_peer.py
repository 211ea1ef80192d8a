"""`pdserve bench peer`: flag validation, the servers' command lines, the
ratio table, and a run with pdserve alone on the tiny model (vLLM is not a
dependency of the project, so the suite never starts it)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys

import pytest

from benchmarks import peer, peer_servers

pytestmark = pytest.mark.timeout(180)


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    peer.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("argv, message", [
    (["--dtypes", "float32,int8"], "--dtypes: 'int8' is not one of"),
    (["--systems", "vllm,sglang"], "--systems: 'sglang' is not one of"),
    (["--dtypes", ""], "--dtypes and --systems need at least one entry"),
    (["--concurrency", "0"], "--concurrency must be >= 1, got 0"),
    (["--num-requests", "0"], "--num-requests must be >= 1"),
    (["--prefill-repeats", "0"], "--prefill-repeats must be >= 1"),
    (["--warmup", "-1"], "--warmup must be >= 0"),
    (["--prefill-len", "4096"], "--max-model-len 2048 is shorter than the longest request "
                                "(4097 tokens)"),
    (["--vllm-env", "NOEQUALS"], "--vllm-env must be KEY=VALUE"),
    (["--kv-cache-gib", "0"], "--kv-cache-gib must be >= 1"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1"),
])
def test_bad_flags_are_refused_by_name(argv, message):
    # --systems pdserve: no vLLM needed to reach every check but --systems's own
    base = ["--systems", "pdserve"] if "--systems" not in argv else []
    with pytest.raises(ValueError, match=re.escape(message)):
        peer.config_from_args(_args(base + argv))


def test_main_reports_a_bad_flag_and_exits_2(capsys):
    assert peer.main(_args(["--systems", "pdserve", "--concurrency", "0"])) == 2
    assert "error: --concurrency must be >= 1" in capsys.readouterr().err


def test_vllm_python_must_exist_and_import_vllm(tmp_path):
    with pytest.raises(ValueError, match="no executable file there"):
        peer.config_from_args(_args(["--vllm-python", str(tmp_path / "python")]))
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ValueError, match="cannot import vllm"):
            peer.config_from_args(_args(["--vllm-python", sys.executable]))
        with pytest.raises(ValueError, match="not importable by this python"):
            peer.config_from_args(_args([]))


def test_server_command_lines_carry_the_shared_settings():
    settings = peer_servers.ServerSettings(
        vllm_python="/venv/bin/python", kv_cache_gib=3, max_num_seqs=16, max_model_len=1100,
        max_num_batched_tokens=256, pod_args=("--block-size=32",),
        vllm_args=("--enforce-eager",), vllm_env=(("VLLM_CPU_SGL_KERNEL", "1"),))
    argv = peer_servers.pdserve_argv("/m/pdserve-base", "bfloat16", 9000, settings)
    assert argv[1:8] == ["-m", "pdserve", "up", "--prefill", "0", "--decode", "0"]
    assert argv[argv.index("--colocated") + 1] == "1"
    assert argv[argv.index("--port") + 1] == "9000"
    pod_args = [a.removeprefix("--pod-arg=") for a in argv if a.startswith("--pod-arg=")]
    assert pod_args == ["--dtype=bfloat16", "--kv-cache-memory=3GiB", "--max-num-seqs=16",
                        "--max-model-len=1100", "--max-num-batched-tokens=256",
                        "--block-size=32"]
    argv = peer_servers.vllm_argv("/venv/bin/python", "/m/pdserve-base", "bfloat16", 9001,
                                  settings)
    assert argv[:4] == ["/venv/bin/python", str(peer_servers.LAUNCHER), "serve",
                        "/m/pdserve-base"]
    flags = dict(zip(argv[4::2], argv[5::2], strict=False))
    assert flags["--dtype"] == "bfloat16" and flags["--max-model-len"] == "1100"
    assert flags["--max-num-seqs"] == "16" and flags["--served-model-name"] == "pdserve-base"
    assert {"--disable-log-stats", "--disable-uvicorn-access-log", "--enforce-eager"} <= set(argv)
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "256"
    env = peer_servers.vllm_env(settings)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["VLLM_CPU_SGL_KERNEL"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(
        str(c) for c in sorted(os.sched_getaffinity(0)))


def _system(tok_s: float, itl50: float, itl99: float, ttft50: float, prefill: float) -> dict:
    stats = {"mean": 1.0, "p50": 1.0, "p90": 1.0, "p99": 1.0}
    return {"workload": {"output_throughput": tok_s, "errors": 0,
                         "itl_ms": {**stats, "p50": itl50, "p99": itl99},
                         "ttft_ms": {**stats, "p50": ttft50}, "tpot_ms": stats},
            "prefill": {"ttft_median_ms": prefill, "errors": 0}}


def test_ratios_are_pdserve_over_vllm_per_metric(capsys):
    results = {"float32": {"vllm": _system(80, 40, 50, 4000, 500),
                           "pdserve": _system(100, 30, 100, 2000, None)}}
    ratios = peer.ratios(results)["float32"]
    assert ratios["output tok/s"] == pytest.approx(1.25)
    assert ratios["ITL p50 (ms)"] == pytest.approx(0.75)
    assert ratios["ITL p99 (ms)"] == pytest.approx(2.0)
    assert ratios["TTFT p50 (ms)"] == pytest.approx(0.5)
    assert ratios["prefill TTFT median (ms)"] is None
    report = {"model": "m", "cpus": "0,1", "results": results, "ratios": {"float32": ratios},
              "workload": {"num_requests": 48, "input_len": 256, "output_len": 64,
                           "concurrency": 8, "prefill_len": 1024, "prefill_repeats": 3,
                           "token_count": "logprobs"}}
    peer.print_tables(report)
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ")}
    assert rows["output tok/s"] == "| output tok/s | 80.0 | 100.0 | 1.25x | >= 1.0 |"
    assert rows["ITL p99 (ms)"] == "| ITL p99 (ms) | 50.0 | 100.0 | 2.00x | <= 1.0 |"
    assert rows["prefill TTFT median (ms)"].endswith("| 500.0 | — | — | <= 1.0 |")


def test_peer_runs_pdserve_alone_on_the_tiny_model(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "peer.json"
    args = _args(["--systems", "pdserve", "--model", str(tiny_model_dir), "--dtypes", "float32",
                  "--num-requests", "4", "--concurrency", "2", "--input-len", "16",
                  "--output-len", "4", "--prefill-len", "64", "--prefill-repeats", "2",
                  "--warmup", "1", "--max-model-len", "256", "--kv-cache-gib", "1",
                  "--out", str(out), "--log-dir", str(tmp_path / "logs")])
    assert peer.main(args) == 0
    report = json.loads(out.read_text())
    result = report["results"]["float32"]["pdserve"]
    assert result["workload"]["completed"] == 4 and result["workload"]["output_tokens"] == 16
    assert result["prefill"]["completed"] == 2
    assert all(r["prompt_len"] == 64 for r in result["prefill"]["requests"])
    assert result["prefill"]["ttft_median_ms"] > 0 and result["startup_s"] > 0
    assert report["ratios"] == {} and report["settings"]["max_model_len"] == 256
    assert result["command"][2:5] == ["pdserve", "up", "--prefill"] and result["env"] == {}
    assert (tmp_path / "logs" / "pdserve-float32.log").is_file()
    table = capsys.readouterr().out
    assert "| metric | pdserve |" in table and "| output tok/s |" in table


def test_vllm_preloads_intel_openmp_from_its_environment_unless_overridden(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    python = str(tmp_path / "bin" / "python")
    assert peer_servers.vllm_preload(python).split(":")[-1] == str(
        tmp_path / "lib" / "libiomp5.so")
    assert "libiomp5" not in peer_servers.vllm_preload(str(tmp_path / "bare" / "bin" / "python"))
    settings = peer_servers.ServerSettings(vllm_python=python, vllm_env=(("LD_PRELOAD", ""),))
    assert peer_servers.vllm_env(settings)["LD_PRELOAD"] == ""


def test_free_ports_come_from_below_the_ephemeral_range():
    """A pod binding port 0 cannot take a port the benchmark picked for its
    router before the router binds it (the CI machine once saw a pod's
    /metrics answer on the router's port)."""
    import socket

    low = peer_servers._ephemeral_low()
    ports = {peer_servers.free_port() for _ in range(20)}
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free
        if low > peer_servers._MIN_PORT + 1024:
            assert peer_servers._MIN_PORT <= port < low
    assert len(ports) > 1  # random, not one port for every server
