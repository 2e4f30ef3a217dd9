"""The house's measures: class sizes, function sizes and import circles of engine/ and service/.

    python .ci/house.py            # the report
    python .ci/house.py --check    # exit 1 on an import circle, an unexcused class over the method cap
                                   # or a record built with 5+ positional arguments

Static (ast) only: nothing is imported. Type-only imports (under ``if TYPE_CHECKING:``) count as imports, since a
circle through them still ties the modules together; function-local imports count too.
"""
from __future__ import annotations

import argparse
import ast
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "service")
MAX_METHODS = 25
# Classes allowed past the cap, each with its reason (the "without a written reason").
EXCUSED: dict[str, str] = {
    "engine.core.scheduler.Scheduler":
        "the batch policy: its queues, seat counts and KV allocator are one piece of state that schedule() and "
        "update_from_output() move together; split, that state would have two owners. The features' state is "
        "outside it (beam_search.BeamSearches, core/speculation.py, core/grammar.py, core/prompt_logprobs.py).",
}


@dataclass(slots=True)
class Module:
    name: str
    tree: ast.Module


def modules() -> list[Module]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found.append(Module(name, ast.parse(path.read_text(), str(path))))
    return found


def class_sizes(mods: list[Module]) -> list[tuple[int, str]]:
    sizes = []
    for mod in mods:
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.ClassDef):
                n = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                sizes.append((n, f"{mod.name}.{node.name}"))
    return sorted(sizes, reverse=True)


def function_lengths(mods: list[Module]) -> list[tuple[int, str]]:
    lengths = []
    for mod in mods:
        for node in ast.walk(mod.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lengths.append((node.end_lineno - node.lineno + 1, f"{mod.name}.{node.name}"))
    return sorted(lengths, reverse=True)


def record_names(mods: list[Module]) -> set[str]:
    """The classes that are plain records: dataclasses and NamedTuples."""
    names = set()
    for mod in mods:
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.ClassDef) and (_is_dataclass(node) or any(
                    getattr(b, "id", getattr(b, "attr", "")) == "NamedTuple" for b in node.bases)):
                names.add(node.name)
    return names


def _is_dataclass(node: ast.ClassDef) -> bool:
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if getattr(target, "id", getattr(target, "attr", "")) == "dataclass":
            return True
    return False


def wide_positional_calls(mods: list[Module], least: int = 5) -> list[str]:
    """Records (``record_names``) built with ``least`` or more positional arguments."""
    records, calls = record_names(mods), []
    for mod in mods:
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Call) and len(node.args) >= least:
                callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if callee in records:
                    calls.append(f"{mod.name}:{node.lineno} {callee}({len(node.args)})")
    return sorted(calls)


def import_graph(mods: list[Module]) -> dict[str, set[str]]:
    names = {m.name for m in mods}
    graph: dict[str, set[str]] = {m.name: set() for m in mods}
    for mod in mods:
        package = mod.name if _is_package(mod) else mod.name.rpartition(".")[0]
        for node in ast.walk(mod.tree):
            for target in _targets(node, package, names):
                while target and target not in names:
                    target = target.rpartition(".")[0]
                if target and target != mod.name:
                    graph[mod.name].add(target)
    return graph


def _is_package(mod: Module) -> bool:
    return (ROOT / mod.name.replace(".", "/") / "__init__.py").exists()


def _targets(node: ast.AST, package: str, names: set[str]) -> list[str]:
    """The modules an import statement names: ``from pkg import mod`` is an edge to ``pkg.mod`` only."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        up = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(up + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found, key=len, reverse=True)


def report(mods: list[Module]) -> None:
    classes = class_sizes(mods)
    print(f"classes over {MAX_METHODS} methods:")
    for n, name in classes:
        if n > MAX_METHODS:
            print(f"  {n:3d}  {name}" + (f"  (excused: {EXCUSED[name]})" if name in EXCUSED else ""))
    lengths = [n for n, _ in function_lengths(mods)]
    q = statistics.quantiles(lengths, n=100)
    print(f"functions: {len(lengths)}; lines median {statistics.median(lengths):.0f}, p90 {q[89]:.0f}, "
          f"p99 {q[98]:.0f}, max {max(lengths)}; over 30 lines: {sum(n > 30 for n in lengths)}, "
          f"over 50: {sum(n > 50 for n in lengths)}")
    print("longest:", ", ".join(f"{name} {n}" for n, name in function_lengths(mods)[:5]))
    wide = wide_positional_calls(mods)
    print(f"records built with 5 or more positional arguments: {len(wide)}")
    for call in wide:
        print(f"  {call}")
    found = circles(import_graph(mods))
    print(f"import circles: {len(found)}")
    for component in found:
        print(f"  {len(component)}: {' '.join(component)}")


def check(mods: list[Module]) -> list[str]:
    problems = [f"{name} has {n} methods (cap {MAX_METHODS}; excuse it in EXCUSED with a reason)"
                for n, name in class_sizes(mods) if n > MAX_METHODS and name not in EXCUSED]
    problems += [f"built positionally: {call}" for call in wide_positional_calls(mods)]
    problems += [f"import circle: {' -> '.join(c)}" for c in circles(import_graph(mods))]
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    mods = modules()
    if not parser.parse_args().check:
        report(mods)
        return
    problems = check(mods)
    print("\n".join(problems) or "house ok")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
