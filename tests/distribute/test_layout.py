"""dtape/distribute's modules import one another one way: no import cycle, no function-local import hiding one."""
import ast
import pathlib

import dtape.distribute

PACKAGE = pathlib.Path(dtape.distribute.__file__).parent


def _imports():
    """{module: (imported dtape.distribute modules, [function-local import lines])}."""
    out = {}
    for path in sorted(PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text())
        deps, local = set(), []
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if node.col_offset > 0:
                local.append(f"{path.name}:{node.lineno}")
            if isinstance(node, ast.ImportFrom) and node.module == "dtape.distribute":
                deps.update(a.name for a in node.names if (PACKAGE / f"{a.name}.py").exists())
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dtape.distribute."):
                deps.add(node.module.split(".")[2])
        out[path.stem] = (deps, local)
    return out


def _cycle(graph):
    """One import cycle as a list of modules, or None."""
    state = {}

    def visit(m, path):
        state[m] = "open"
        for d in sorted(graph.get(m, ())):
            if state.get(d) == "open":
                return path[path.index(d):] + [d]
            if d not in state:
                found = visit(d, path + [d])
                if found:
                    return found
        state[m] = "done"
        return None
    for m in sorted(graph):
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


def test_distribute_modules_have_no_import_cycle_and_no_function_local_imports():
    imports = _imports()
    local = [line for _, lines in imports.values() for line in lines]
    assert not local, f"function-local imports (move the shared name to a lower module): {local}"
    cycle = _cycle({m: deps for m, (deps, _) in imports.items()})
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"
