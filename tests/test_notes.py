"""Exception notes on every supported Python (BaseException.add_note is 3.11+; pyproject allows 3.10)."""
import types

import pytest

from dtape import _notes
from dtape.distribute import collective_ops
from dtape.distribute.multi_worker_mirrored_strategy import MultiWorkerMirroredStrategy


class _Python310Error(ValueError):
    """An exception as on Python 3.10: no add_note method."""

    @property
    def add_note(self):
        raise AttributeError("'_Python310Error' object has no attribute 'add_note' (Python 3.10)")


@pytest.fixture(params=[True, False], ids=["add_note", "python310"])
def error_cls(request, monkeypatch):
    """ValueError where add_note exists; on the python310 leg an exception type without it."""
    monkeypatch.setattr(_notes, "_HAS_ADD_NOTE", request.param)
    return ValueError if request.param else _Python310Error


def test_add_note_keeps_notes_and_shows_them_without_add_note(error_cls):
    e = error_cls("bad batch")
    _notes.add_note(e, "first")
    _notes.add_note(e, "second")
    assert e.__notes__ == ["first", "second"]
    assert str(e) == ("bad batch" if error_cls is ValueError else "bad batch\nfirst\nsecond")


def test_peer_exception_note_names_the_failing_rank(error_cls, monkeypatch):
    monkeypatch.setattr(collective_ops, "_exception_class", lambda module, qualname: error_cls)
    try:
        raise error_cls("w")
    except ValueError as exc:
        payload = collective_ops.error_payload(exc, 3, 4)
    err = collective_ops.peer_exception(payload, 0, "all_reduce #2")
    assert type(err) is error_cls
    assert "rank 3 of 4" in err.__notes__[0] and "all_reduce #2" in err.__notes__[0]


def test_worker_report_notes_this_rank_once_then_publishes(error_cls):
    published = []
    fake = types.SimpleNamespace(_resolver=types.SimpleNamespace(rank=1, world_size=2),
                                 _comm=types.SimpleNamespace(publish_error=published.append))
    e = error_cls("bad batch")
    MultiWorkerMirroredStrategy._report(fake, e)
    MultiWorkerMirroredStrategy._report(fake, e)
    assert e.__notes__ == ["(raised on worker rank 1 of 2)"]
    assert published == [e, e]
