"""The chart's named API keys: a Secret mounted whole (so key rotation
reaches the router without a restart) and `--api-keys-file` naming it."""

from __future__ import annotations

import pytest

from tests.helm.chart import PREFIX, RenderError, container, find, flag_values, render

pytestmark = pytest.mark.timeout(60)


def test_the_keys_secret_is_mounted_whole_and_named_by_the_flag() -> None:
    docs = render({"router": {"apiKeys": {"existingSecret": "router-keys"}}})
    deployment = find(docs, "Deployment", f"{PREFIX}-router")
    main = container(deployment, "router")
    assert flag_values(main["args"])["--api-keys-file"] == "/etc/pdserve/api-keys/keys"
    mount = next(m for m in main["volumeMounts"] if m["name"] == "api-keys")
    assert mount == {"name": "api-keys", "mountPath": "/etc/pdserve/api-keys",
                     "readOnly": True}  # no subPath: Secret updates reach the file
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == "api-keys")
    assert volume["secret"] == {"secretName": "router-keys"}
    assert "PDSERVE_API_KEY" not in str(main.get("env"))
    assert "--api-keys-file" not in str(render())  # off by default


def test_one_key_and_a_keys_file_are_exclusive() -> None:
    with pytest.raises(RenderError, match="router.apiKeys and router.apiKey are exclusive"):
        render({"router": {"apiKey": {"value": "k"}, "apiKeys": {"existingSecret": "s"}}})
