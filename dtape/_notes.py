"""`add_note` for every supported Python: `BaseException.add_note` is 3.11+, and pyproject allows 3.10.

Layer 0 (stdlib only).
"""

_HAS_ADD_NOTE = hasattr(BaseException, "add_note")  # Python >= 3.11


def add_note(exc, note):
    """`exc.add_note(note)`, with a fallback for Python 3.10.

    The fallback keeps the notes in `exc.__notes__` as 3.11 does (what code
    reading the notes looks at), and appends the note to a plain one-string
    message so 3.10 tracebacks, which do not print `__notes__`, show it.
    """
    if _HAS_ADD_NOTE:
        exc.add_note(note)
        return
    notes = getattr(exc, "__notes__", None)
    exc.__notes__ = (notes if isinstance(notes, list) else []) + [note]
    if len(exc.args) == 1 and isinstance(exc.args[0], str) and type(exc).__str__ is BaseException.__str__:
        exc.args = (f"{exc.args[0]}\n{note}",)
