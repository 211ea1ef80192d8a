import pytest

# helpers.py asserts on behalf of the tests: let pytest explain its failures too
pytest.register_assert_rewrite("tests.kv_transfer.helpers", "tests.kv_transfer.tcp.raw")
