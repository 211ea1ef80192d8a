from kv_transfer.base import KVLayout
from kv_transfer.outgoing import Piece, plan_pieces


def test_pieces_cover_k_and_v_ranges():
    layout = KVLayout(2, 10, 1, 4, "float32")  # row = 16 bytes
    pieces = plan_pieces(layout, 1, 3, 5, num_streams=2, max_chunk_bytes=4096)
    assert pieces == [Piece(1, 3 * 16, 0, 5 * 16), Piece(1, 13 * 16, 5 * 16, 5 * 16)]
    pieces = plan_pieces(layout, 1, 3, 5, num_streams=4, max_chunk_bytes=4096)
    assert pieces == [
        Piece(1, 3 * 16, 0, 3 * 16),
        Piece(1, 6 * 16, 3 * 16, 2 * 16),
        Piece(1, 13 * 16, 5 * 16, 3 * 16),
        Piece(1, 16 * 16, 8 * 16, 2 * 16),
    ]


def test_pieces_respect_max_chunk():
    layout = KVLayout(1, 1000, 8, 128, "bfloat16")  # row = 2048 bytes
    pieces = plan_pieces(layout, 0, 0, 1000, num_streams=1, max_chunk_bytes=65536)
    assert all(p.length <= 65536 and p.length % 2048 == 0 for p in pieces)
    assert sum(p.length for p in pieces) == layout.bytes_per_layer
    assert len(pieces) == 63  # 2000 rows (K and V, one run) / 32 rows per piece


def test_a_whole_layer_is_one_run_cut_about_once_per_stream():
    layout = KVLayout(2, 10, 1, 4, "float32")  # row = 16 bytes, 20 rows per layer
    pieces = plan_pieces(layout, 1, 0, 10, num_streams=3, max_chunk_bytes=4096)
    assert pieces == [Piece(1, 0, 0, 7 * 16), Piece(1, 7 * 16, 7 * 16, 7 * 16),
                      Piece(1, 14 * 16, 14 * 16, 6 * 16)]  # fmt: skip


def test_pieces_stay_above_the_minimum_and_rotate_over_the_streams():
    layout = KVLayout(1, 1000, 8, 128, "bfloat16")  # row = 2048 bytes, 4,096,000 per layer
    pieces = plan_pieces(layout, 0, 0, 1000, num_streams=8, max_chunk_bytes=4 << 20,
                         min_chunk_bytes=1 << 20)  # fmt: skip
    assert [p.length for p in pieces] == [512 * 2048, 512 * 2048, 512 * 2048, 464 * 2048]
    assert [p.offset for p in pieces] == [p.src_start for p in pieces] == [
        0, 512 * 2048, 1024 * 2048, 1536 * 2048]  # fmt: skip
    # the maximum wins over the minimum; a run shorter than the minimum is one piece
    assert {p.length for p in plan_pieces(layout, 0, 0, 1000, 8, 65536, 1 << 20)} == {
        65536, 16 * 2048}  # 2000 rows = 62 pieces of 32 rows + 16
    assert len(plan_pieces(layout, 0, 0, 10, 8, 4 << 20, 1 << 20)) == 2  # K and V


def test_sender_config_names_a_bad_minimum():
    import pytest

    from kv_transfer.config import SenderConfig

    with pytest.raises(ValueError, match=r"min_chunk_bytes must be in \[0, "):
        SenderConfig(min_chunk_bytes=-1)
