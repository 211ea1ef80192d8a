"""kernels/native builds wherever a C compiler is present. The native test
files skip when `native.library()` is None, which is also what a source
that does not compile gives; this test is what fails then, with the
compiler's message."""

from __future__ import annotations

import pytest

from kernels import native
from kernels.native import loader


@pytest.mark.skipif(loader._compiler() is None, reason="no C compiler (cc or gcc) on PATH")
def test_the_native_sources_compile_where_a_compiler_is_present() -> None:
    assert native.build().is_file()  # raises with the compiler's complaint
    assert native.library() is not None
