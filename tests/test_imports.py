"""The shared modules' floors: every import runs down (or along a floor), never up, and never round
a loop. The floors are the README's file table, so the README stays true as files are added."""

import ast
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOORS = ["ground", "plumbing", "kit", "scripts"]  # bottom to top


PACKAGES = ["rlhf", "rlhf/evaluation", "worlds"]  # the plumbing's package (eval.py's own part) and the worlds


def forks(root=ROOT):
    """The root's .py files that git does not track: a user's copies of a script (my_grpo.py) are
    theirs, and the project's rules are not checked on them. Outside a git checkout: none."""
    tracked = subprocess.run(["git", "ls-files", "--", "*.py"], cwd=root, capture_output=True, text=True)
    if tracked.returncode:
        return set()
    return {f for f in os.listdir(root) if f.endswith(".py")} - set(tracked.stdout.split())


def readme_floors():
    """{module: floor index} from the README's `| floor | `[folder/]file.py` | ... |` rows; a module
    in a folder is named as Python imports it (`rlhf.sampling`)."""
    rows = re.findall(r"^\| (\w+) \| `([\w/]+)\.py` \|", open(os.path.join(ROOT, "README.md")).read(), re.M)
    return {module.replace("/", "."): FLOORS.index(floor) for floor, module in rows if floor in FLOORS}


def project_modules(root=ROOT):
    """{dotted module name: file} for the root's modules and those of the package folders."""
    files = {f[:-3]: os.path.join(root, f) for f in os.listdir(root) if f.endswith(".py") and f not in forks(root)}
    for pkg in PACKAGES:
        files.update({f"{pkg.replace('/', '.')}.{f[:-3]}": os.path.join(root, pkg, f) for f in os.listdir(os.path.join(root, pkg))
                      if f.endswith(".py") and f != "__init__.py"})
    return files


def project_imports():
    """{module: set of project modules it imports}, function-level imports included. `from rlhf
    import sampling` and `from rlhf.sampling import x` both import `rlhf.sampling`."""
    files = project_modules()
    graph = {}
    for m, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                deps.add(node.module)
                deps |= {f"{node.module}.{a.name}" for a in node.names}
        graph[m] = (deps & set(files)) - {m}
    return graph


def test_the_root_holds_the_scripts_and_common_only():
    """The design card's shape: at the root the scripts a user runs and common.py; plumbing in rlhf/,
    the worlds in worlds/ (README, "Files")."""
    scripts = [m for m, floor in readme_floors().items() if floor == FLOORS.index("scripts")]
    root = sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py") and f not in forks())
    assert root == sorted(scripts + ["common"]), root


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


def test_the_folders_show_the_layers():
    """Nothing in rlhf/ or worlds/ imports a module of the root (common.py or a script): the
    folders, not only the README's table, hold the plumbing below the scripts."""
    graph = project_imports()
    up = [f"{m} imports {d}" for m, deps in graph.items() if m.startswith(("rlhf.", "worlds.")) for d in deps if "." not in d]
    assert not up, up


def test_a_fork_at_the_root_is_not_the_projects(tmp_path):
    """A copy of a script beside it, untracked, is left out of the checks above (shown in a git
    checkout of its own, so the project's folder is never written); the project's own files are
    all tracked."""
    assert "grpo.py" not in forks()
    for pkg in PACKAGES:
        os.makedirs(tmp_path / pkg)
    (tmp_path / "grpo.py").write_text(open(os.path.join(ROOT, "grpo.py")).read())
    git = {"cwd": tmp_path, "check": True, "capture_output": True}
    subprocess.run(["git", "init", "-q"], **git)
    subprocess.run(["git", "add", "grpo.py"], **git)
    (tmp_path / "my_grpo.py").write_text((tmp_path / "grpo.py").read_text())
    assert forks(tmp_path) == {"my_grpo.py"}
    assert set(project_modules(tmp_path)) == {"grpo"}


def test_a_module_in_a_package_is_seen_in_both_import_forms(tmp_path, monkeypatch):
    """`from rlhf import sampling` and `from rlhf.sampling import x` are both edges to rlhf.sampling."""
    graph = project_imports()
    assert "rlhf.sampling" in graph["grpo"] and "rlhf.basics" in graph["rlhf.reward_contract"]


def test_an_old_path_names_the_new_one(monkeypatch):
    """--tools calculator.py:add (the path before the move) stops with a sentence naming worlds/calculator.py."""
    import pytest

    from rlhf import tools

    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as e:
        tools.load_tools("calculator.py:add")
    assert "it moved to worlds/calculator.py" in str(e.value)
    assert [t.name for t in tools.load_tools("worlds/calculator.py:add")] == ["add"]
