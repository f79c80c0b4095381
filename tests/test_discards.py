"""The controller's book of recent discards (tq.discards): pure logic, tested directly."""

from __future__ import annotations

import pytest

from tq import discards
from tq.discards import DiscardBook
from tq.errors import InvalidRequestError


def test_a_discard_is_new_applied_or_fenced_and_a_fence_never_undoes_an_applied_one():
    book = DiscardBook()
    assert book.check(None) is None and book.check(5) is None
    book.record(5, 3)
    assert book.check(5) == 3  # sent again: answered with the first reply's count
    assert book.abort([5, 6]) == [True, False]
    with pytest.raises(InvalidRequestError, match="discard 6 was given up on"):
        book.check(6)
    assert book.abort([6]) == [False]  # fencing twice is harmless
    restored = DiscardBook.restore(book.snapshot())
    assert restored.check(5) == 3 and restored.abort([6]) == [False]
    with pytest.raises(InvalidRequestError):
        restored.check(6)


def test_the_book_keeps_the_most_recent_ids_of_each_kind(monkeypatch):
    monkeypatch.setattr(discards, "RECENT", 4)
    book = DiscardBook()
    book.abort([100])
    for i in range(1, 11):  # many applied discards do not push the one fence out
        book.record(i, 1)
    assert list(book.applied) == [7, 8, 9, 10]
    with pytest.raises(InvalidRequestError):
        book.check(100)
    book.abort([101, 102, 103, 104])
    assert list(book.fenced) == [101, 102, 103, 104]
