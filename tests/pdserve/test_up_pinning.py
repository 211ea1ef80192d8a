"""pdserve/commands/_up_pinning.py: `pdserve up --pin auto` gives CPU pods
disjoint CPUs where there are enough, and says why where it does not."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdserve.commands import _cpus, _up_pinning, up
from pdserve.commands._up_pinning import plan_pinning, pods_on_cuda

EIGHT = tuple(range(8))


def _plan(pods, cpus=EIGHT, on_cuda=False, pinned=()):
    return plan_pinning(pods, cpus, on_cuda=on_cuda, pinned_roles=set(pinned))


def test_one_prefill_and_one_decode_pod_get_a_core_each_on_two():
    plan = _plan([("prefill", 1), ("decode", 1)], cpus=(0, 1))
    assert dict(plan.cpus) == {"prefill": "0", "decode": "1"}
    assert plan.message == ("pods pinned to disjoint CPUs: prefill-0 on CPU 0, decode-0 on "
                            "CPU 1 (--pin off shares them)")


def test_leftover_cpus_go_to_prefill_pods_first_and_shares_are_contiguous():
    # 7 CPUs, 3 pods: 2 each and the one left over to the prefill pod
    plan = _plan([("decode", 1), ("prefill", 1), ("decode", 1)], cpus=tuple(range(7)))
    assert dict(plan.cpus) == {"prefill": "0-2", "decode": "3-4/5-6"}
    assert "prefill-0 on CPU 0-2, decode-0 on CPU 3-4, decode-1 on CPU 5-6" in plan.message


def test_a_tensor_parallel_pod_counts_one_cpu_per_rank():
    # prefill TP=2 + decode TP=1 on 6 CPUs: 3 units of 2 CPUs, the pod of size 2 gets two
    plan = _plan([("prefill", 2), ("decode", 1)], cpus=tuple(range(6)))
    assert dict(plan.cpus) == {"prefill": "0-3", "decode": "4-5"}
    # 2 CPUs cannot hold 3 rank processes
    short = _plan([("prefill", 2), ("decode", 1)], cpus=(0, 1))
    assert short.cpus == ()
    assert short.message == ("2 CPUs for 3 pod processes: they share them (--pin auto needs "
                             "one CPU per process)")


def test_no_pinning_on_a_gpu_or_when_a_role_has_its_own_list():
    gpu = _plan([("prefill", 1), ("decode", 1)], on_cuda=True)
    assert gpu.cpus == () and "pods on a GPU" in gpu.message
    given = _plan([("prefill", 1), ("decode", 1)], pinned=("decode",))
    assert given.cpus == () and given.message.startswith("--decode-cpus given")


def test_gaps_in_the_allowed_cpus_are_kept_out_of_the_lists():
    plan = _plan([("prefill", 1), ("decode", 1)], cpus=(0, 2, 4, 6))
    assert dict(plan.cpus) == {"prefill": "0,2", "decode": "4,6"}


@pytest.mark.parametrize(("pod_args", "expected"), [
    (["--device=cuda"], True), (["--device", "cpu"], False),
    (["--device=cuda", "--device=cpu"], False),  # the last one wins, as argparse's
])
def test_the_pods_device_is_read_from_their_flags(pod_args, expected):
    assert pods_on_cuda(pod_args) is expected


def _config(*argv: str):
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    return up.config_from_args(parser.parse_args(list(argv)))


def _four_cpus(monkeypatch) -> None:
    """This process may run on CPUs 0-3, as far as `up` and its checks know."""
    monkeypatch.setattr(_cpus, "allowed_cpus", lambda: (0, 1, 2, 3))
    monkeypatch.setattr(_up_pinning, "allowed_cpus", lambda: (0, 1, 2, 3))


def test_up_pins_by_default_and_passes_each_pod_its_list(monkeypatch):
    _four_cpus(monkeypatch)
    said: list[str] = []
    config = _up_pinning.pin_pods(_config("--pod-arg=--device=cpu", "--decode", "2"), said.append)
    argvs = [up.pod_argv(role, Path("/m"), config, Path("/r"), i)
             for role, i in (("prefill", 0), ("decode", 0), ("decode", 1))]
    assert [argv[argv.index("--cpus") + 1] for argv in argvs] == ["0-1", "2", "3"]
    assert "--cpus" not in up.router_argv(Path("/m"), config, [])
    assert said == ["pods pinned to disjoint CPUs: prefill-0 on CPU 0-1, decode-0 on CPU 2, "
                    "decode-1 on CPU 3 (--pin off shares them)"]


def test_pin_off_and_a_given_list_leave_the_other_pods_unpinned(monkeypatch):
    _four_cpus(monkeypatch)
    said: list[str] = []
    off = _up_pinning.pin_pods(_config("--pod-arg=--device=cpu", "--pin", "off"), said.append)
    assert off.cpus == () and said == []
    given = _up_pinning.pin_pods(_config("--pod-arg=--device=cpu", "--prefill-cpus", "0"),
                                 said.append)
    assert given.cpus_of("prefill") == "0" and given.cpus_of("decode") is None
    assert said == ["--prefill-cpus given: other pods share the CPUs"]
    with pytest.raises(SystemExit):
        _config("--pin", "always")
