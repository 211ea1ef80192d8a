"""The router's local-prefill switches in the chart: on by default (the
router's own defaults, so no flag is passed), `false` renders the
`--no-...` switch."""

from __future__ import annotations

import pytest

from tests.helm.chart import CLI_FLAGS, PREFIX, container, find, flag_values, render

pytestmark = pytest.mark.timeout(60)


def _router_args(values: dict | None = None) -> dict[str, str]:
    main = container(find(render(values or {}), "Deployment", f"{PREFIX}-router"), "router")
    flags = flag_values(main["args"])
    assert set(flags) <= CLI_FLAGS["router"]
    return flags


def test_the_within_budget_local_rule_and_warm_up_are_turned_off_by_switches() -> None:
    off = _router_args({"router": {"localPrefillWithinBudget": False,
                                   "localPrefillWarm": False, "warmSessionAnswers": False}})
    switches = ("--no-local-prefill-within-budget", "--no-local-prefill-warm",
                "--no-warm-session-answers")
    assert [off[s] for s in switches] == [""] * 3
    default = _router_args()
    assert not any(s in default for s in switches)
