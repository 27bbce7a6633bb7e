"""The user documentation runs: every ```python block of docs/*.md and README.md, and every dtape name cited.

Each file's python blocks run in order, in one namespace, in a fresh
temporary working directory. A block whose first line is
`# doc: torchrun (...)` is a multi-process script: a page's such blocks run
together as one script under `torchrun --standalone --nproc-per-node 2` (CPU
workers, gloo). A block whose first line is `# doc: skip (<reason>)` is not
run (it needs CUDA); the reason must be given. Names cited in backticks (`dtape.layers.Dense`,
`dtape.GradientTape.gradient`) must exist, except on lines that say a
feature is not there yet ("Status:"); and a name such a line calls missing
must really be missing, so the status lines cannot go stale silently.
"""
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.S | re.M)
SKIP = re.compile(r"#\s*doc:\s*skip\s*\((.+)\)")
TORCHRUN = re.compile(r"#\s*doc:\s*torchrun\b")
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
        reason = skip.group(1) if skip else ("torchrun" if TORCHRUN.match(first) else None)
        blocks.append((text.count("\n", 0, m.start()) + 1, source, reason))
    return blocks


def torchrun_blocks(path):
    return [(line, source) for line, source, reason in python_blocks(path) if reason == "torchrun"]


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
            if skip is not None:   # a skipped or a torchrun block
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


@pytest.mark.multiprocess
@pytest.mark.parametrize("path", [p for p in PAGES if torchrun_blocks(p)], ids=lambda p: p.name)
def test_torchrun_blocks_run(path, tmp_path):
    # Padded so that tracebacks give the page's line numbers.
    lines = []
    for line, source in torchrun_blocks(path):
        lines += [""] * (line - len(lines)) + source.splitlines()
    script = tmp_path / path.name.replace(".md", "_torchrun.py")
    script.write_text("\n".join(lines) + "\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", DTAPE_DISTRIBUTE_TIMEOUT="30")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                             "--nproc-per-node", "2", "--monitor-interval", "0.1", str(script)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)       # torchrun and its workers
        output = proc.communicate()[0] + "\n[killed after 120 s]"
    assert proc.returncode == 0, f"{path.name}: the torchrun blocks failed:\n{output[-4000:]}"


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
    skipped = [(p.name, line, skip) for p in PAGES for line, _, skip in python_blocks(p)
               if skip not in (None, "torchrun")]
    assert runnable >= 20, runnable
    assert len(skipped) <= 3, skipped


if __name__ == "__main__":  # python tests/test_docs.py: the counts, for the report
    for p in PAGES:
        blocks = python_blocks(p)
        print(f"{p.name}: {sum(s is None for *_, s in blocks)} run, {len(torchrun_blocks(p))} under torchrun, "
              f"{sum(s not in (None, 'torchrun') for *_, s in blocks)} skipped")
    print(len(cited_names()), "names cited")
    sys.exit(0)
