"""The runner's persistent block table."""

import torch

from engine.runner.block_table import BlockTable


def test_rows_hold_their_blocks_through_growth():
    table = BlockTable(block_size=1, rows=2, width=2)
    a, b = table.acquire(), table.acquire()
    table.set(a, [7, 3])
    table.append(b, [1])
    c = table.acquire()  # rows double
    table.append(c, [9, 8, 6, 5, 4])  # width doubles twice
    table.append(a, [2])
    assert table.blocks(a, 3).tolist() == [7, 3, 2]
    assert table.blocks(b, 1).tolist() == [1]
    assert table.blocks(c, 5).tolist() == [9, 8, 6, 5, 4]
    assert table.gather(torch.tensor([c, a]), 2).tolist() == [[9, 8], [7, 3]]
    assert len({a, b, c}) == 3


def test_released_rows_are_reused_and_reset():
    table = BlockTable(block_size=1, rows=2, width=4)
    a = table.acquire()
    table.set(a, [5, 6, 7])
    table.release(a)
    again = table.acquire()
    assert again == a
    table.append(again, [1])  # a fresh row starts at its first entry
    assert table.blocks(again, 1).tolist() == [1]


def test_set_replaces_a_resumed_requests_blocks():
    table = BlockTable(block_size=1)
    row = table.acquire()
    table.set(row, [1, 2, 3])
    table.set(row, [8])
    table.append(row, [9])
    assert table.blocks(row, 2).tolist() == [8, 9]


def test_slots_and_tables_in_tokens():
    table = BlockTable(block_size=4)
    row = table.acquire()
    table.set(row, [10, 3, 7])
    assert table.slot(row, 0) == 40 and table.slot(row, 5) == 13 and table.slot(row, 11) == 31
    assert table.slots(row, 2, 10) == [42, 43, 12, 13, 14, 15, 28, 29]
    assert table.blocks(row, 5).tolist() == [10, 3]  # 5 tokens span 2 blocks
    assert table.gather(torch.tensor([row]), 9).tolist() == [[10, 3, 7]]
