"""The user documentation runs: every ```python block of docs/*.md and README.md, and every dtape name cited.

Each file's python blocks run in order, in one namespace, in a fresh
temporary working directory. A block whose first line is a comment
`# doc: skip (<reason>)` is not run (it needs CUDA or torchrun); the reason
must be given. Names cited in backticks (`dtape.layers.Dense`,
`dtape.GradientTape.gradient`) must exist, except on lines that say a
feature is not there yet ("Status:"); and a name such a line calls missing
must really be missing, so the status lines cannot go stale silently.
"""
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.S | re.M)
SKIP = re.compile(r"#\s*doc:\s*skip\s*\((.+)\)")
# A backticked dotted dtape name, e.g. `dtape.nn.relu` or `dtape.GradientTape(...)`.
NAME = re.compile(r"`(dtape(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
STATUS = "Status:"


def python_blocks(path):
    """[(line number, source, skip reason or None)] of the ```python blocks of `path`, in order."""
    text = path.read_text()
    blocks = []
    for m in FENCE.finditer(text):
        if m.group(1) != "python":
            continue
        source = m.group(2)
        first = source.lstrip().splitlines()[0] if source.strip() else ""
        skip = SKIP.match(first)
        blocks.append((text.count("\n", 0, m.start()) + 1, source, skip.group(1) if skip else None))
    return blocks


def test_every_page_is_found_and_linked_from_the_index():
    names = {p.name for p in PAGES}
    expected = {"index.md", "api.md", "from_tensorflow.md", "for_pytorch_users.md", "semantics.md",
                "failures.md", "torch_interop.md", "README.md"}
    assert expected <= names
    index = (ROOT / "docs" / "index.md").read_text()
    for page in expected - {"index.md", "README.md"}:
        assert f"({page})" in index, f"docs/index.md does not link {page}"


@pytest.mark.parametrize("path", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_python_blocks_run(path, tmp_path, monkeypatch):
    blocks = python_blocks(path)
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": f"doc_{path.stem}"}
    import dtape.debugging
    try:
        for line, source, skip in blocks:
            if skip is not None:
                assert skip.strip(), f"{path.name}:{line}: '# doc: skip (...)' needs a reason"
                continue
            code = compile("\n" * line + source, str(path), "exec")   # tracebacks give the file's line numbers
            try:
                exec(code, namespace)
            except Exception as error:
                raise AssertionError(f"{path.name}: the python block starting at line {line} failed: "
                                     f"{type(error).__name__}: {error}") from error
    finally:
        dtape.debugging.disable_check_numerics()  # a page must not leave global checks on for other tests
        for value in namespace.values():          # stop the replica threads of the page's strategies
            close = getattr(value, "close", None)
            if type(value).__name__ == "MirroredStrategy" and callable(close):
                close()


def _resolve(dotted):
    import importlib
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            try:
                obj = importlib.import_module(".".join(parts[:i + 1]))
            except ImportError:
                return False
    return True


def cited_names():
    """{name: [(page, line number, is a status line)]} of the dtape names cited in backticks."""
    found = {}
    for path in PAGES:
        in_status = False   # a "> Status: ..." blockquote, over all its lines
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            in_status = STATUS in line or (in_status and line.startswith(">"))
            for name in NAME.findall(line):
                found.setdefault(name, []).append((path.name, number, in_status))
    return found


def test_cited_names_exist():
    missing, stale = [], []
    for name, places in sorted(cited_names().items()):
        exists = _resolve(name)
        for page, number, status in places:
            if not status and not exists:
                missing.append(f"{page}:{number}: {name}")
            if status and exists:
                stale.append(f"{page}:{number}: {name}")
    assert not missing, "docs cite names that do not exist: " + "; ".join(missing)
    assert not stale, ("a 'Status:' line says these are not there yet, but they now exist; document them "
                       "and update the status line: " + "; ".join(stale))


def test_expected_errors_are_checked():
    # `try: f() / except E: assert ...` passes when f() raises nothing; an example must say so (else: raise).
    import ast
    unchecked = []
    for path in PAGES:
        for line, source, skip in python_blocks(path):
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.Try) and node.handlers and not node.orelse:
                    unchecked.append(f"{path.name}:{line + node.lineno}")
    assert not unchecked, "try/except without an else that fails when nothing is raised: " + ", ".join(unchecked)


def test_enough_names_are_checked():
    # The reference cites the public surface; a broken regex would check nothing.
    names = cited_names()
    assert len(names) > 120, len(names)
    assert "dtape.GradientTape" in names and "dtape.distribute.MirroredStrategy" in names


def test_blocks_are_counted():
    runnable = sum(1 for p in PAGES for _, _, skip in python_blocks(p) if skip is None)
    skipped = [(p.name, line, skip) for p in PAGES for line, _, skip in python_blocks(p) if skip is not None]
    assert runnable >= 20, runnable
    assert len(skipped) <= 3, skipped


if __name__ == "__main__":  # python tests/test_docs.py: the counts, for the report
    for p in PAGES:
        blocks = python_blocks(p)
        print(f"{p.name}: {sum(s is None for *_, s in blocks)} run, {sum(s is not None for *_, s in blocks)} skipped")
    print(len(cited_names()), "names cited")
    sys.exit(0)
