import pytest
import torch

from decode.packing import pack_rows, packed_positions


def test_packed_positions_restart_at_each_sequence_and_at_a_rows_tail():
    lengths = [3, 2, 4]
    rows = pack_rows(lengths, 5)  # [[2], [0, 1]]: 2 x 5 cells
    positions, places = packed_positions(lengths, rows)
    assert rows == [[2], [0, 1]]
    assert positions.tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
    assert positions.dtype == torch.long
    assert places == [(1, 0), (1, 3), (0, 0)]  # input order: (row, start column)


def test_packed_positions_refuse_a_layout_that_loses_or_repeats_a_sequence():
    with pytest.raises(ValueError, match="each of the 3 sequences once"):
        packed_positions([1, 2, 3], [[0, 1]])
    with pytest.raises(ValueError, match="each of the 2 sequences once"):
        packed_positions([1, 2], [[0, 1], [1]])
