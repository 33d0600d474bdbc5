import pytest

from specjax.constants import PADDING_SLOT_ID, check_index_range, next_power_of_2


@pytest.mark.parametrize("n, want", [(-3, 1), (0, 1), (1, 1), (2, 2), (3, 4), (5, 8), (16, 16),
                                     (17, 32), (2**40 + 1, 2**41)])
def test_next_power_of_2(n, want):
    assert next_power_of_2(n) == want


def test_constants():
    assert PADDING_SLOT_ID == -1
    check_index_range("x", 2**31 - 1)
    with pytest.raises(ValueError, match="x=2147483648"):
        check_index_range("x", 2**31)
