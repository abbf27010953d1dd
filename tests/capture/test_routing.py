"""Routed experts: the stored dtype, and engine rows checked against their request."""

import numpy as np
import pytest

from rollfeed.capture import RoutingShapeError, align_routed_experts, routed_dtype


def test_routed_dtype():
    assert routed_dtype(8) == np.uint8 and routed_dtype(256) == np.uint8
    assert routed_dtype(257) == np.uint16 and routed_dtype(65536) == np.uint16
    with pytest.raises(RoutingShapeError):
        routed_dtype(0)
    with pytest.raises(RoutingShapeError):
        routed_dtype(70000)


def test_align_routed_experts_rows_and_prompt_start():
    routed = np.arange(4 * 2 * 2).reshape(4, 2, 2) % 8  # prompt 3 + completion 2 - 1 rows
    out = align_routed_experts(routed, prompt_len=3, completion_len=2, num_experts=8)
    assert out.dtype == np.uint8 and np.array_equal(out, routed)
    later = align_routed_experts(
        routed[2:], prompt_len=3, completion_len=2, num_experts=300, prompt_start=2
    )
    assert later.dtype == np.uint16 and np.array_equal(later, routed[2:])
    with pytest.raises(RoutingShapeError, match=r"needs \[4, layers, top_k\]"):
        align_routed_experts(
            np.zeros((5, 2, 2), np.int64), prompt_len=3, completion_len=2, num_experts=8
        )  # a row for the final token: not what engines emit
    bad = routed.copy()
    bad[3, 1, 0] = 8
    with pytest.raises(RoutingShapeError, match="outside") as err:
        align_routed_experts(bad, prompt_len=3, completion_len=2, num_experts=8)
    assert (err.value.field, err.value.pos) == ("routed_experts", 3)  # the request position
    with pytest.raises(RoutingShapeError, match="outside") as err:
        align_routed_experts(bad[2:], prompt_len=3, completion_len=2, num_experts=8, prompt_start=2)
    assert err.value.pos == 3
    with pytest.raises(RoutingShapeError, match="integer"):
        align_routed_experts(routed.astype(float), prompt_len=3, completion_len=2, num_experts=8)
    with pytest.raises(RoutingShapeError, match="prompt_start"):
        align_routed_experts(routed, prompt_len=3, completion_len=2, num_experts=8, prompt_start=4)
