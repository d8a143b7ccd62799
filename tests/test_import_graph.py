"""No import circles inside kprof: every `import` of one kprof module by another, at module level or inside
a function (a lazy import is still a dependency), read from the source, forms a graph with no cycle."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kprof"


def _modules() -> dict[str, tuple[pathlib.Path, str]]:
    """module name -> (file, the package its relative imports resolve against)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
            package = ".".join(parts)
        else:
            package = ".".join(parts[:-1])
        out[".".join(parts)] = (path, package)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {name: set() for name in modules}
    for name, (path, package) in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                # `from pkg import sub` depends on the submodule when there is one, else on pkg itself
                targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # `import kprof.ledger.keys as k` -> that module
                    target = target.rpartition(".")[0]
                if target.startswith("kprof") and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_scan_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert "kprof.ceilings" in graph["kprof.api"]  # a lazy, relative import inside a function
    assert "kprof.runners.catalog" in graph["kprof.runners.registry"]
    assert "kprof.measure._nvml_access" in graph["kprof.measure._nvml_telemetry"]


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_inside_kprof():
    assert cycles(import_graph()) == []


def test_the_ledger_imports_nothing_from_measure_runners_or_cli():
    graph = import_graph()
    upward = {(module, dep) for module, deps in graph.items() if module.startswith("kprof.ledger")
              for dep in deps if dep.startswith(("kprof.runners", "kprof.measure", "kprof.cli"))}
    assert upward == set()


def test_the_ledger_stays_small_and_plain():
    """Issue 17's bounds on the ledger: at most 2,300 lines in all and 400 in a module, and nothing in it that reads
    the process's memory maps, calls C by hand, or parses a dependency's bytes itself."""
    files = sorted((PACKAGE / "ledger").glob("*.py"))
    lines = {path.name: len(path.read_text().splitlines()) for path in files}
    assert sum(lines.values()) <= 2300, lines
    assert max(lines.values()) <= 400, lines
    for path in files:
        text = path.read_text()
        for needle in ("/proc", "ctypes", "madvise", "struct.unpack", "msgpack.unpack"):
            assert needle not in text, (path.name, needle)
