"""`proto.registry`: the Redis pod record's key and JSON format."""

from __future__ import annotations

import json

import pytest

from proto.registry import parse_pod_record


def test_pod_record_round_trip_and_validation() -> None:
    heartbeat_value = json.dumps(
        {"address": "10.1.2.3:50051", "role": "decode", "model": "tiny", "started_at": 5.0}
    )
    record = parse_pod_record(heartbeat_value)
    assert record.key == "pdserve:pods:decode:10.1.2.3:50051"
    assert parse_pod_record(record.to_json()) == record
    with pytest.raises(ValueError, match="malformed pod record"):
        parse_pod_record('{"role": "decode"}')
    with pytest.raises(ValueError, match="pod role must be one of"):
        parse_pod_record('{"address": "h:1", "role": "router"}')
    with pytest.raises(ValueError, match="pod address must be host:port"):
        parse_pod_record('{"address": "h", "role": "decode"}')
