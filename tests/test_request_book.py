"""The controller's book of recent destructive requests (tq.request_book): pure logic, tested directly."""

from __future__ import annotations

import pytest

from tq import request_book
from tq.request_book import RequestBook
from tq.errors import InvalidRequestError


def test_a_request_is_new_applied_or_fenced_and_a_fence_never_undoes_an_applied_one():
    book = RequestBook()
    assert book.check("discard", None) is None and book.check("discard", 5) is None
    book.record(5, 3)
    assert book.check("discard", 5) == 3  # sent again: answered with the first reply's count
    assert book.abort([5, 6]) == [3, None]
    with pytest.raises(InvalidRequestError, match="clear_partition 6 was given up on"):
        book.check("clear_partition", 6)
    assert book.abort([6]) == [None]  # fencing twice is harmless
    restored = RequestBook.restore(book.snapshot())
    assert restored.check("discard", 5) == 3 and restored.abort([6]) == [None]
    with pytest.raises(InvalidRequestError):
        restored.check("discard", 6)


def test_the_book_keeps_the_most_recent_ids_of_each_kind(monkeypatch):
    monkeypatch.setattr(request_book, "RECENT", 4)
    book = RequestBook()
    book.abort([100])
    for i in range(1, 11):  # many applied discards do not push the one fence out
        book.record(i, 1)
    assert list(book.applied) == [7, 8, 9, 10]
    with pytest.raises(InvalidRequestError):
        book.check("discard", 100)
    book.abort([101, 102, 103, 104])
    assert list(book.fenced) == [101, 102, 103, 104]
