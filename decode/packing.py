"""Packed layouts: several sequences laid end to end in one row of a forward, each with its own positions.

A packed row holds whole sequences, each with position ids restarting at 0, and the forward carries no
``attention_mask``: transformers' masking utilities (``masking_utils.find_packed_sequence_indices``) read the
sequence boundaries from the position ids and build a block-diagonal causal mask, so no token attends across
sequences (sdpa, eager and flex attention; flash attention only detects packing in a single row). The forward
must run with ``use_cache=False``. Teacher-forced scoring (``decode.teacher_forcing``) and packed training
(``distill.training.packing``) both lay their rows out here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pack_rows(lengths: Sequence[int], max_len: int) -> list[list[int]]:
    """Which examples share a row: the layout with the fewest cells (rows x the fullest row's tokens).

    Rows are filled first-fit decreasing under a cap on a row's tokens, trying one cap per row count r
    (the total over r, at least the longest example, at most ``max_len``); ties go to the narrower layout
    (attention costs a row's length squared). A cap of the longest example is among them, so the layout never
    has more cells than padding each example to the longest: a cap of ``max_len`` alone would, when a few
    long examples fill one row and leave another almost empty.

    Args:
        lengths: tokens of each example, each in ``1..max_len``.
        max_len: tokens a row holds at most.

    Returns:
        One list of example indices per row, examples in a row longest first.

    Raises:
        ValueError: a length outside ``1..max_len``.
    """
    if not lengths or any(not 1 <= n <= max_len for n in lengths):
        raise ValueError(f"every length must be in 1..{max_len}, got {list(lengths)}")
    longest, total = max(lengths), sum(lengths)
    caps = sorted({min(max_len, max(longest, -(-total // r))) for r in range(1, len(lengths) + 1)})
    layouts = [_first_fit_decreasing(lengths, cap) for cap in caps]

    def cost(rows: list[list[int]]) -> tuple[int, int]:
        width = max(sum(lengths[i] for i in row) for row in rows)
        return len(rows) * width, width

    return min(layouts, key=cost)


def _first_fit_decreasing(lengths: Sequence[int], cap: int) -> list[list[int]]:
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: ties keep their order
        row = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if row is None:
            rows.append([])
            room.append(cap)
            row = len(rows) - 1
        rows[row].append(i)
        room[row] -= lengths[i]
    return rows


def packed_positions(lengths: Sequence[int], rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Position ids of a packed layout and where each sequence starts in it.

    Args:
        lengths: tokens of each sequence.
        rows: sequence indices per row, in row order (:func:`pack_rows`' output); each index once.

    Returns:
        ``positions`` ``(rows, width)`` int64, width the fullest row's tokens: 0, 1, ... restarting at each
        sequence, and again over a row's unused tail (a block of its own that no sequence attends to); and per
        sequence, in input order, its ``(row, start column)``.

    Raises:
        ValueError: ``rows`` does not hold each of the sequences exactly once.
    """
    if sorted(i for row in rows for i in row) != list(range(len(lengths))):
        raise ValueError(f"the rows must hold each of the {len(lengths)} sequences once, got {[list(r) for r in rows]}")
    width = max(sum(lengths[i] for i in row) for row in rows)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    places: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            positions[r, start:start + lengths[i]] = torch.arange(lengths[i])
            places[i] = (r, start)
            start += lengths[i]
        positions[r, start:] = torch.arange(width - start)
    return positions, places
