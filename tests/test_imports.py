"""The shared modules' floors: every import runs down (or along a floor), never up, and never round
a loop. The floors are the README's file table, so the README stays true as files are added."""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOORS = ["ground", "plumbing", "kit", "scripts"]  # bottom to top


def readme_floors():
    """{module: floor index} from the README's `| floor | `file.py` | ... |` rows."""
    rows = re.findall(r"^\| (\w+) \| `(\w+)\.py` \|", open(os.path.join(ROOT, "README.md")).read(), re.M)
    return {module: FLOORS.index(floor) for floor, module in rows if floor in FLOORS}


def project_imports():
    """{module: set of project modules it imports}, function-level imports included."""
    modules = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")}
    graph = {}
    for m in modules:
        deps = set()
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, m + ".py")).read())):
            if isinstance(node, ast.Import):
                deps |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                deps.add(node.module.split(".")[0])
        graph[m] = (deps & modules) - {m}
    return graph


def loops(graph):
    """Modules that can reach themselves through the import graph."""
    def reaches(start):
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(graph[m])
        return seen
    return sorted(m for m in graph if m in reaches(m))


def test_every_module_has_a_floor_in_the_readme():
    missing = sorted(set(project_imports()) - set(readme_floors()))
    assert not missing, f"add {missing} to the README's file table, on the floor above everything they import"


def test_imports_only_run_down_or_along_a_floor():
    floors, graph = readme_floors(), project_imports()
    up = [f"{m} ({FLOORS[floors[m]]}) imports {d} ({FLOORS[floors[d]]})"
          for m, deps in graph.items() for d in deps if m in floors and d in floors and floors[d] > floors[m]]
    assert not up, up


def test_no_import_loops():
    assert loops(project_imports()) == []


def test_the_loop_finder_finds_a_loop():
    assert loops({"common": {"data"}, "data": {"basics", "common"}, "basics": set()}) == ["common", "data"]
    assert loops({"common": {"data"}, "data": {"basics"}, "basics": set()}) == []


def test_no_shared_module_imports_common():
    graph = project_imports()
    below = [m for m, floor in readme_floors().items() if floor < FLOORS.index("kit")]
    assert not [m for m in below if "common" in graph.get(m, ())]
