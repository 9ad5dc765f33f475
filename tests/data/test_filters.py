import pytest

from rlax_tpu.data.filters import prefilter


def test_prefilter_keeps_partially_solved_and_counts_drops():
    result = prefilter({"a": 0.0, "b": 0.25, "c": 1.0, "d": 0.9}, low=0.0, high=0.9)
    assert result.kept == ("b",)
    assert result.dropped_solved == ("c", "d")
    assert result.dropped_unsolved == ("a",)
    assert result.dropped == 3


def test_prefilter_bad_input():
    with pytest.raises(ValueError, match="pass rate of 'x' is 1.5"):
        prefilter({"x": 1.5})
    with pytest.raises(ValueError, match="need 0 <= low < high <= 1"):
        prefilter({}, low=0.5, high=0.5)
