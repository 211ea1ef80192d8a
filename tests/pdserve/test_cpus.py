"""pdserve/commands/_cpus.py: CPU lists, the flags that take them, and pinning
a real process."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.commands import _cpus, _pod_flags, up

REPO_ROOT = Path(__file__).resolve().parents[2]
EIGHT = tuple(range(8))


@pytest.mark.parametrize("text, cpus", [
    ("0", (0,)), ("0-1", (0, 1)), ("0,2", (0, 2)), ("3,0-1", (0, 1, 3)),
    ("0-3,6-7", (0, 1, 2, 3, 6, 7)), (" 1 , 1 ", (1,)),
])
def test_cpu_lists_parse_to_sorted_ids(text, cpus):
    assert _cpus.parse_cpu_list(text, EIGHT) == cpus


@pytest.mark.parametrize("text, message", [
    ("", "'' is not a CPU id or a range"),
    ("a", "'a' is not a CPU id"),
    ("0-", "'0-' is not a CPU id"),
    ("-1", "'-1' is not a CPU id"),
    ("3-1", "range 3-1 runs backwards"),
    ("0,9-10", "CPU 9-10 is not available"),
])
def test_bad_cpu_lists_name_the_list_and_the_allowed_cpus(text, message):
    with pytest.raises(ValueError, match=message) as info:
        _cpus.parse_cpu_list(text, EIGHT)
    assert f"CPU list {text!r}" in str(info.value)
    assert "this machine allows CPUs 0-7" in str(info.value)


def test_format_cpu_list_round_trips():
    assert _cpus.format_cpu_list((5, 0, 1, 2, 7)) == "0-2,5,7"
    assert _cpus.parse_cpu_list(_cpus.format_cpu_list((0, 1, 3, 4)), EIGHT) == (0, 1, 3, 4)


def test_pod_flags_take_cpus_and_threads(capsys):
    parser = argparse.ArgumentParser()
    _pod_flags.add_engine_arguments(parser, block_size=16, prefix_cache_default=True)
    first = min(os.sched_getaffinity(0))
    args = parser.parse_args(["--model", "/m", "--cpus", str(first), "--threads", "2"])
    assert (args.cpus, args.threads) == ((first,), 2)
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "/m", "--cpus", "100000"])
    err = capsys.readouterr().err
    assert "argument --cpus: CPU list '100000': CPU 100000 is not available" in err
    assert "this machine allows CPUs " + _cpus.format_cpu_list(_cpus.allowed_cpus()) in err


def test_up_passes_each_role_its_cpu_list():
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    first = min(os.sched_getaffinity(0))
    config = up.config_from_args(parser.parse_args(
        ["--prefill-cpus", str(first), "--router-cpus", f"{first}-{first}"]))
    assert config.cpus_of("prefill") == config.cpus_of("router") == str(first)
    assert config.cpus_of("decode") is None
    argv = up.pod_argv("prefill", Path("/m"), config, Path("/r"))
    assert argv[argv.index("--cpus") + 1] == str(first)
    assert "--cpus" not in up.pod_argv("decode", Path("/m"), config, Path("/r"))
    with pytest.raises(ValueError, match="--decode-cpus: CPU list '100000'"):
        up.config_from_args(parser.parse_args(["--decode-cpus", "100000"]))


def test_up_gives_each_pod_of_a_role_its_own_list_when_split_by_slash():
    """`--colocated-cpus 0/1`: pod 0 on CPU 0, pod 1 on CPU 1, pod 2 on 0
    again (one pod per core or NUMA node, as a GPU node runs one per GPU)."""
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    cpus = _cpus.allowed_cpus()
    a, b = str(cpus[0]), str(cpus[-1])
    config = up.config_from_args(parser.parse_args(
        ["--prefill", "0", "--decode", "0", "--colocated", "3", "--colocated-cpus", f"{a}/{b}"]))
    pinned = [up.pod_argv("colocated", Path("/m"), config, Path("/r"), i) for i in range(3)]
    assert [argv[argv.index("--cpus") + 1] for argv in pinned] == [a, b, a]
    assert config.cpus_of("colocated", 1) == b
    with pytest.raises(ValueError, match="--colocated-cpus: CPU list '100000'"):
        up.config_from_args(parser.parse_args(["--colocated-cpus", f"{a}/100000"]))
    with pytest.raises(ValueError, match="--router-cpus .*one list for the router's processes"):
        up.config_from_args(parser.parse_args(["--router-cpus", f"{a}/{b}"]))


def test_pin_process_pins_every_thread_and_sizes_torch():
    """In a fresh interpreter (pinning is process-wide): a thread started
    before the pin is moved too, and torch runs one thread per CPU."""
    cpu = min(os.sched_getaffinity(0))
    code = f"""
import os, threading, time, torch
from pdserve.commands._cpus import pin_process
stop = threading.Event()
worker = threading.Thread(target=stop.wait); worker.start()
pin_process(({cpu},))
print(sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(worker.native_id)),
      torch.get_num_threads())
stop.set(); worker.join()
pin_process(None, 3)
print(torch.get_num_threads())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                         timeout=60, check=True).stdout.split("\n")
    assert out[0] == f"[{cpu}] [{cpu}] 1"
    assert out[1] == "3"
    with pytest.raises(ValueError, match="--threads must be >= 1, got 0"):
        _cpus.pin_process(None, 0)


def test_up_passes_router_args_to_the_router():
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    config = up.config_from_args(parser.parse_args(
        ["--router-arg=--local-prefill-max-tokens=128", "--router-arg=--max-queue-wait=5"]))
    argv = up.router_argv(Path("/m"), config, [])
    assert argv[-2:] == ["--local-prefill-max-tokens=128", "--max-queue-wait=5"]
    assert "--local-prefill-max-tokens=128" not in up.pod_argv("decode", Path("/m"), config,
                                                               Path("/r"))


def test_up_passes_role_args_to_that_role_only():
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    config = up.config_from_args(parser.parse_args(
        ["--pod-arg=--num-blocks=256", "--decode-arg=--prefix-cache"]))
    decode = up.pod_argv("decode", Path("/m"), config, Path("/r"))
    assert decode[-2:] == ["--num-blocks=256", "--prefix-cache"]
    for role in ("prefill", "colocated"):
        argv = up.pod_argv(role, Path("/m"), config, Path("/r"))
        assert argv[-1] == "--num-blocks=256" and "--prefix-cache" not in argv


def test_nice_applies_to_every_thread_and_is_bounded(capsys):
    """--nice: every thread alive at the call gets it (Linux keeps one per
    thread), a thread started after inherits it; 0-19 only."""
    code = """
import os, threading
from pdserve.commands._cpus import pin_process
stop = threading.Event()
before = threading.Thread(target=stop.wait); before.start()
pin_process(None, nice=7, torch_threads=False)
after = threading.Thread(target=stop.wait); after.start()
print(*[os.getpriority(os.PRIO_PROCESS, t) for t in
        (before.native_id, after.native_id, threading.get_native_id())])
stop.set(); before.join(); after.join()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                         timeout=60, check=True).stdout
    assert out.split() == ["7", "7", "7"]
    parser = argparse.ArgumentParser()
    _pod_flags.add_engine_arguments(parser, block_size=16, prefix_cache_default=True)
    assert parser.parse_args(["--model", "/m", "--nice", "19"]).nice == 19
    assert parser.parse_args(["--model", "/m"]).nice == 0
    for bad in ("20", "-1", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--model", "/m", "--nice", bad])
        assert "must be a whole number from 0 to 19" in capsys.readouterr().err


def test_a_pod_process_spins_briefly_unless_the_operator_chose(monkeypatch):
    """libgomp's default spin held a shared core for milliseconds after each
    region (docs/engine.md, "OpenMP pools"); pods get POD_SPIN_COUNT, and an
    operator's GOMP_SPINCOUNT or OMP_WAIT_POLICY is left alone."""
    from pdserve.commands import _cpus

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    _cpus.default_pod_spin()
    assert os.environ["GOMP_SPINCOUNT"] == str(_cpus.POD_SPIN_COUNT)
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    _cpus.default_pod_spin()
    assert os.environ["GOMP_SPINCOUNT"] == "300000"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    _cpus.default_pod_spin()
    assert "GOMP_SPINCOUNT" not in os.environ


def test_pod_commands_set_the_spin_before_torch_loads(tiny_model_dir):
    """`pdserve serve` reaches its engine with GOMP_SPINCOUNT set (read by
    libgomp when torch loads it); `pdserve bench` keeps libgomp's default."""
    from tests.integration.pods import REPO_ROOT

    script = ("import os, sys\n"
              "from pdserve import cli\n"
              "cli.build_parser = lambda argv: (_ for _ in ()).throw(SystemExit(0))\n"
              "try:\n"
              "    cli.main(sys.argv[1:])\n"
              "except SystemExit:\n"
              "    pass\n"
              "print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    for command, want in (("serve", "2000"), ("bench", "None")):
        out = subprocess.run([sys.executable, "-c", script, command, "--model",
                              str(tiny_model_dir)], cwd=REPO_ROOT, env=env, check=True,
                             capture_output=True, text=True, timeout=120).stdout.split()
        assert out == [want, "False"], (command, out)
