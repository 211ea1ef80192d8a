"""`pdserve bench transfer` and `transfer-split` run end to end on a tiny shape
(their figures are for docs/benchmarks.md; here only that every path moves the
bytes and the table is complete)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import transfer, transfer_split

pytestmark = pytest.mark.timeout(120)


def _args(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def test_transfer_benchmark_prints_every_path(capsys):
    args = _args(transfer, ["--requests", "2", "--layers", "2", "--tokens", "64",
                            "--streams", "1,3", "--repeats", "2",
                            "--min-chunk-mib", "0.01"])  # fmt: skip
    assert transfer.main(args) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    paths = [(row.split("|")[1].strip(), row.split("|")[2].strip()) for row in rows[1:]]
    expected = []
    for streams in ("1", "3"):
        expected += [("ceiling", streams), ("grpc-plain", "1 call"), ("tcp", streams),
                     ("tcp-xxh64", streams), ("grpc", streams)]  # fmt: skip
    assert paths == expected
    for row in rows[1:]:
        path, median_ratio = row.split("|")[1].strip(), row.split("|")[5].strip()
        if path in ("ceiling", "grpc-plain"):
            assert median_ratio == "-"
        else:
            assert median_ratio.endswith("%") and int(median_ratio[:-1]) > 0


def test_transfer_benchmark_no_checksum_diagnostic_leaves_checksums_on_after(capsys):
    import kv_transfer.tcp.receiver as receiver
    import kv_transfer.tcp.stream as stream
    from kv_transfer.checksum import data_checksum

    args = _args(transfer, ["--requests", "1", "--layers", "2", "--tokens", "64",
                            "--streams", "2", "--repeats", "1",
                            "--connectors", "tcp-no-checksum,tcp"])  # fmt: skip
    assert transfer.main(args) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["ceiling", "tcp-no-checksum", "tcp"]
    assert stream.data_checksum is data_checksum and receiver.data_checksum is data_checksum


def test_transfer_benchmark_grpc_over_mutual_tls(capsys, tmp_path):
    import shutil

    from tests.tls_certs import make_certs

    certs = make_certs(tmp_path / "certs")
    secret = tmp_path / "secret"  # laid out as the pods' Secret is mounted
    secret.mkdir()
    for source, name in ((certs.pod_cert, "tls.crt"), (certs.pod_key, "tls.key"),
                         (certs.ca, "ca.crt")):
        shutil.copy(source, secret / name)
    args = _args(transfer, ["--requests", "1", "--layers", "2", "--tokens", "64",
                            "--streams", "2", "--repeats", "1", "--connectors", "grpc-tls",
                            "--tls-dir", str(secret)])  # fmt: skip
    assert transfer.main(args) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split("|")[1].strip() for row in rows[1:]] == [
        "ceiling", "grpc-plain", "grpc-tls"]
    assert "of grpc-plain" in rows[-1]
    with pytest.raises(ValueError, match="needs --tls-dir"):
        transfer.main(_args(transfer, ["--requests", "1", "--layers", "2", "--tokens", "64",
                                       "--streams", "1", "--connectors", "grpc-tls"]))


def test_transfer_split_benchmark_prints_every_path(capsys):
    args = _args(transfer_split, ["--requests", "1", "--layers", "2", "--tokens", "64",
                                  "--streams", "2", "--rounds", "2"])  # fmt: skip
    assert transfer_split.main(args) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split("|")[1].strip() for row in rows[1:]] == list(transfer_split.PATHS)
    assert all(float(row.split("|")[3]) > 0 for row in rows[1:])
