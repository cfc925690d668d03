"""Bugs planted in private copies of the Triton copy kernel's index math (issue 33), to
show that tests/impl/test_triton_copy.py fails on them. Import it only where Triton
imports, with ``TRITON_INTERPRET`` as the kernels under test were built."""

from __future__ import annotations

import triton
import triton.language as tl  # noqa: F401  (the interpreter wants it in a kernel's globals)


@triton.jit
def row_offset_in_page_off_by_one(unit, plane, per_page, page_stride,  # type: ignore[no-untyped-def]
                                  unit_stride, plane_stride):
    """``_row_offset`` with a slot's place in its page one too far (the modulo keeps it
    inside the page, so no memory outside the buffers is touched)."""
    within = (unit + 1) % per_page
    return (unit // per_page) * page_stride + within * unit_stride \
        + plane * plane_stride
