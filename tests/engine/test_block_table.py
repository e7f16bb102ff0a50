"""The runner's persistent block table."""

import numpy as np

from engine.runner.block_table import BlockTable


def test_rows_hold_their_blocks_through_growth():
    table = BlockTable(block_size=1, rows=2, width=2)
    a, b = table.acquire(), table.acquire()
    table.set(a, [[7, 3]])
    table.append(b, [[1]])
    c = table.acquire()  # rows double
    table.append(c, [[9, 8, 6, 5, 4]])  # width doubles twice
    table.append(a, [[2]])
    assert table.blocks(a, 3).tolist() == [7, 3, 2]
    assert table.blocks(b, 1).tolist() == [1]
    assert table.blocks(c, 5).tolist() == [9, 8, 6, 5, 4]
    out = np.empty((2, 2), dtype=np.int32)
    table.gather_into(np.array([c, a]), out)
    assert out.tolist() == [[9, 8], [7, 3]]
    assert len({a, b, c}) == 3


def test_released_rows_are_reused_and_reset():
    table = BlockTable(block_size=1, rows=2, width=4)
    a = table.acquire()
    table.set(a, [[5, 6, 7]])
    table.release(a)
    again = table.acquire()
    assert again == a
    table.append(again, [[1]])  # a fresh row starts at its first entry
    assert table.blocks(again, 1).tolist() == [1]


def test_set_replaces_a_resumed_requests_blocks():
    table = BlockTable(block_size=1)
    row = table.acquire()
    table.set(row, [[1, 2, 3]])
    table.set(row, [[8]])
    table.append(row, [[9]])
    assert table.blocks(row, 2).tolist() == [8, 9]


def test_slots_and_tables_in_tokens():
    table = BlockTable(block_size=4)
    row = table.acquire()
    table.set(row, [[10, 3, 7]])
    assert table.slots_at(np.array([row] * 3), np.array([0, 5, 11])).tolist() == [[40, 13, 31]]
    assert table.slots(row, 2, 10).tolist() == [[42, 43, 12, 13, 14, 15, 28, 29]]
    assert table.blocks(row, 5).tolist() == [10, 3]  # 5 tokens span 2 blocks
    out = np.empty((1, 3), dtype=np.int32)
    table.gather_into(np.array([row]), out)
    assert out.tolist() == [[10, 3, 7]]


def test_groups_hold_their_own_blocks_for_the_same_positions():
    table = BlockTable(block_size=2, rows=1, width=1, num_groups=2)
    row = table.acquire()
    table.set(row, [[4, 5], [9]])  # a sliding group's shorter row (the prompt's rest reserved in full groups only)
    table.append(row, [[], [6]])
    table.append(row, [[7], [8]])  # width doubles
    assert table.blocks(row, 6, group=0).tolist() == [4, 5, 7]
    assert table.blocks(row, 6, group=1).tolist() == [9, 6, 8]
    assert table.slots(row, 1, 4).tolist() == [[9, 10, 11], [19, 12, 13]]
    assert table.slots_at(np.array([row]), np.array([5])).tolist() == [[15], [17]]
    out = np.empty((1, 3), dtype=np.int32)
    table.gather_into(np.array([row]), out, group=1)
    assert out.tolist() == [[9, 6, 8]]
