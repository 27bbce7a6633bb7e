"""One definition of each concept, checked on the source tree itself."""
import ast
import pathlib

import dtape

ROOT = pathlib.Path(dtape.__file__).parent
# Private attributes other modules may read: none; the hot-path "is any tape active" check reads the
# public `tape.active_tapes` (a module attribute: a function call per op would cost more than the check).
ALLOWED_ATTRS = set()


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        yield path, ast.parse(path.read_text())


def _is_private(name):
    return name.startswith("_") and not name.startswith("__")


def _private_reaches(path, tree):
    """`from dtape.x import _name` of a non-module name, and `alias._name` on an imported dtape module."""
    aliases, found = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dtape"):
            for a in node.names:
                is_module = (ROOT.parent / (node.module + "." + a.name).replace(".", "/")).with_suffix(".py").exists()
                if _is_private(a.name) and not is_module:
                    found.append(f"{path.name}:{node.lineno} from {node.module} import {a.name}")
                if is_module:
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.name.startswith("dtape") and a.asname})
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and _is_private(node.attr) and node.attr not in ALLOWED_ATTRS:
            found.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
    return found


def test_no_module_reaches_into_another_modules_private_names():
    found = [f for path, tree in _modules() for f in _private_reaches(path, tree)]
    assert not found, "cross-module private names (give them a public name):\n" + "\n".join(found)


def test_every_thread_local_scope_uses_the_one_mechanism():
    """A class that saves a previous value in __enter__ and restores it in __exit__ must be a
    ThreadLocalScope (dtape/_local.py) instead of a hand-written copy."""
    copies = []
    for path, tree in _modules():
        if path.name == "_local.py":
            continue
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            src = ast.unparse(cls)
            if "def __enter__" in src and "self._prev" in src:
                copies.append(f"{path.name}: {cls.name}")
    assert not copies, f"hand-written thread-local swaps: {copies}"


def test_one_variable_test_and_one_operator_table():
    srcs = {path.name: path.read_text() for path, _ in _modules()}
    duck = [name for name, s in srcs.items() if 'hasattr(' in s and '"_dtape_read"' in s]
    assert not duck, f"duck-typed variable checks (use dtape.tensor.is_variable): {duck}"
    tables = [name for name, s in srcs.items() if "def _delegate(" in s]
    assert tables == ["_dispatch.py"], f"operator tables outside ops/_dispatch.py: {tables}"


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_record_op_is_a_tape_record_op_and_the_walk_probes_none():
    """Record ops follow one protocol (`dtape.tape.RecordOp`): the tape and the walk read its declared
    traits directly and know no op policy, so they never probe an op with getattr."""
    record_ops = set(_subclasses(dtape.tape.RecordOp))
    backward_classes = [(path.name, cls.name) for path, tree in _modules()
                        for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
                        and any(isinstance(f, ast.FunctionDef) and f.name == "backward" for f in cls.body)]
    names = {c.__name__ for c in record_ops}
    outside = [f"{p}: {c}" for p, c in backward_classes if c not in names and c != "RecordOp"]
    assert len(backward_classes) >= 10 and not outside, f"record ops outside the protocol: {outside}"
    for name in ("tape.py", "backprop.py"):
        tree = ast.parse((ROOT / name).read_text())
        probes = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call)
                  and ast.unparse(n.func) == "getattr" and ast.unparse(n.args[0]) in ("op", "rec.op")]
        assert not probes, f"{name} probes record ops: {probes}"
    assert not any(isinstance(v, str) and v in ("other_input", "denominator") for v in vars(dtape.tape).values())
