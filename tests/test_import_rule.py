"""The import rule of docs/architecture.md, read from the source: every import of every module,
those inside functions and under TYPE_CHECKING included, parsed with ``ast`` (nothing is imported).

- The supervisor's packages (api, residency, catalog, settings, cli, daemon) import ``protocol`` and
  never ``engine``, ``models`` or ``kernels``; nor torch or triton.
- ``protocol`` imports nothing of gpushare but itself, and no torch: the contract is torch-free.
- Outside ``engine`` only the worker entry point's callers named below import the engine: ``llm.py``
  (the offline API); the benchmarks and tests are not part of the package.
- No import cycles anywhere in the package.

A failure names the file, the line and the import that breaks the rule.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUPERVISOR = ("api", "residency", "catalog", "settings", "cli", "daemon")
TORCH_SIDE = ("engine", "models", "kernels")
ENGINE_IMPORTERS = ("gpushare.llm",)

# Each exception names its one import and says why; an exception that no longer matches fails too.
EXCEPTIONS = {
    # engine.isolation: thread runs each device's engine on a thread of the daemon's own process: by that
    # setting's definition the supervisor hosts the engine (the default, process, never reaches this import).
    ("gpushare.daemon.serve", "gpushare.engine.local_device"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for folder in ("gpushare",) for p in sorted((ROOT / folder).rglob("*.py"))}


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, imported name) for every import in the file: modules of the package resolved to the
    module itself (``from pkg import module`` names the module), other names as written."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            submodules = [f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" in known]
            found += [(node.lineno, m) for m in submodules] or [(node.lineno, module)]
    return found


def graph() -> dict[str, list[tuple[int, str]]]:
    """Module -> (line, module of the package) for each of its imports of the package."""
    known = package_modules()
    return {name: [(line, target) for line, target in imports(name, path, known) if target in known and target != name]
            for name, path in known.items()}


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def where(module: str, line: int) -> str:
    path = package_modules()[module]
    return f"{path.relative_to(ROOT)}:{line}"


def test_the_supervisor_imports_the_protocol_never_the_engine_models_or_kernels():
    known = package_modules()
    bad, used = [], set()
    for name, path in known.items():
        if package_of(name) not in SUPERVISOR:
            continue
        for line, target in imports(name, path, known):
            top = target.split(".")[0]
            if top in ("torch", "triton") or (top == "gpushare" and package_of(target) in TORCH_SIDE):
                if (name, target) in EXCEPTIONS:
                    used.add((name, target))
                    continue
                bad.append(f"{where(name, line)} imports {target}: {package_of(name)} never imports "
                           f"{'torch' if top != 'gpushare' else package_of(target)} (the supervisor is torch-free)")
    assert not bad, "\n".join(bad)
    assert used == {e for e in EXCEPTIONS if package_of(e[0]) in SUPERVISOR}, "an exception no longer matches"


def test_the_protocol_imports_only_itself_and_no_torch():
    known = package_modules()
    bad = []
    for name, path in known.items():
        if package_of(name) != "protocol":
            continue
        for line, target in imports(name, path, known):
            top = target.split(".")[0]
            outside = top == "gpushare" and package_of(target) != "protocol"
            if (top in ("torch", "triton") or outside) and (name, target) not in EXCEPTIONS:
                bad.append(f"{where(name, line)} imports {target}: the protocol is the torch-free bottom layer")
    assert not bad, "\n".join(bad)


def test_only_the_engine_itself_and_the_offline_api_import_the_engine():
    bad = []
    for name, targets in graph().items():
        if package_of(name) == "engine" or name in ENGINE_IMPORTERS:
            continue
        for line, target in targets:
            if package_of(target) == "engine" and (name, target) not in EXCEPTIONS:
                bad.append(f"{where(name, line)} imports {target}: only the worker side and llm.py import the engine")
    assert not bad, "\n".join(bad)


def cycles(edges: dict[str, list[tuple[int, str]]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, groups, counter = {}, {}, set(), [], [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                target = child[1]
                if target not in index:
                    index[target] = low[target] = counter[0]
                    counter[0] += 1
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(edges[target])))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def test_no_import_cycles():
    edges = {name: [(line, t) for line, t in targets if (name, t) not in EXCEPTIONS]
             for name, targets in graph().items()}
    found = cycles(edges)
    described = ["circle: " + ", ".join(group) + "\n" + "\n".join(
        f"  {where(a, line)} imports {b}" for a in group for line, b in edges[a] if b in group) for group in found]
    assert not found, "\n".join(described)


def test_the_cycle_finder_finds_a_circle():
    edges = {"a": [(1, "b")], "b": [(2, "c")], "c": [(3, "a")], "d": [(4, "a")]}
    assert cycles(edges) == [["a", "b", "c"]]


def test_every_exception_is_an_import_that_exists():
    edges = {(name, target) for name, targets in graph().items() for _, target in targets}
    assert EXCEPTIONS <= edges, f"stale exceptions: {sorted(EXCEPTIONS - edges)}"
