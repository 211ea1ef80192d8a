import xxhash

from kv_transfer.checksum import FLAG_XXH3, checksum, data_checksum


def test_data_checksum_follows_the_flag():
    payload = bytes(range(256)) * 3
    assert data_checksum(payload, 0) == checksum(payload) == xxhash.xxh64_intdigest(payload)
    assert data_checksum(payload, FLAG_XXH3) == xxhash.xxh3_64_intdigest(payload)
    assert data_checksum(payload, FLAG_XXH3) != data_checksum(payload, 0)
