"""The execution verifiers have no false negatives on ordinary code: every correct solution of
tests/correct_solutions.py (imports, classes, recursion, prints, a __main__ block, every fence,
prose around the code, big and deep answers) scores 1 in exec_tests and exec_tests_strict, with
the interpreter where it is, in a private (mode-700) home, in a folder anyone may read, and under
/tmp (which the sandbox covers with its own tmpfs). The attacks of test_sandbox_attacks.py still
score 0; the seccomp filter denies new namespaces, memfd and pidfd."""

import os
import shutil
import sys
import sysconfig
import tempfile

import pytest

from rlhf import sandbox
from tests.correct_solutions import SOLUTIONS, interpreter_copy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the uid drop needs root (sandbox.py docstring)")


def searchable(path):
    """Whether every folder from / to `path` may be entered by others."""
    while os.path.dirname(path) != path:
        if not os.stat(path).st_mode & 0o001:
            return False
        path = os.path.dirname(path)
    return True


def outside_scratch():
    """A folder no scratch tmpfs of the sandbox covers, for a private home to be hidden there: the
    checkout, else (a checkout under /tmp) the home folder."""
    for parent in (ROOT, os.path.expanduser("~")):
        if not any(parent == s or parent.startswith(s + "/") for s in ("/tmp", "/var/tmp", "/dev/shm")):
            return parent
    pytest.skip("no folder outside /tmp, /var/tmp and /dev/shm to hold a private home")


@pytest.fixture(params=["where it is", "private home", "readable folder", "private folder under /tmp"])
def interpreter(request, monkeypatch):
    """(kind, folder): sys.executable is this one (folder None) or a copy in folder/python."""
    if request.param == "where it is":
        yield request.param, None
        return
    # outside /tmp (the sandbox's scratch tmpfs hides it) unless that is the case under test
    parent = tempfile.gettempdir() if "/tmp" in request.param else outside_scratch()
    if request.param == "readable folder" and not searchable(parent):
        pytest.skip(f"{parent} is not readable by others")
    folder = tempfile.mkdtemp(prefix=".interpreter-", dir=parent)  # mode 700: a private home
    try:
        if request.param == "readable folder":
            os.chmod(folder, 0o755)
        monkeypatch.setattr(sys, "executable", interpreter_copy(os.path.join(folder, "python")))
        yield request.param, folder
    finally:
        shutil.rmtree(folder)


@pytest.mark.parametrize("verifier", [sandbox.exec_tests, sandbox.exec_tests_strict], ids=lambda v: v.__name__)
def test_every_correct_solution_scores_one(verifier, interpreter):
    assert len(SOLUTIONS) >= 50
    names = list(SOLUTIONS)
    scores = verifier(prompts=["p"] * len(names), completions=[SOLUTIONS[n][0] for n in names],
                      tests=[SOLUTIONS[n][1] for n in names])
    assert {n: s for n, s in zip(names, scores) if s != 1.0} == {}


LOOK = ("import os\n"
        "def listing(path):\n    try:\n        return sorted(os.listdir(path))\n    except OSError as e:\n        return e.strerror\n"
        "def write(path):\n    try:\n        open(path + '/x', 'w').close()\n        return 'written'\n    except OSError as e:\n"
        "        return e.strerror\n")


@as_root
def test_a_private_home_shows_the_code_its_standard_library_only(interpreter):
    """The interpreter's library is shown again in the sandbox, read-only; nothing else of the private home is."""
    kind, folder = interpreter
    if folder is None or kind == "readable folder":
        pytest.skip("only a private home is covered")
    with open(os.path.join(folder, "secret.txt"), "w") as f:
        f.write("the tests")
    stdlib = sysconfig.get_paths(vars={"installed_base": os.path.join(folder, "python")})["stdlib"]
    code = LOOK + "def can_write(path):\n    return write(path) == 'written'\nimport typing"
    tests = [f"assert listing({folder!r}) == ['python']", f"assert can_write({stdlib!r}) == False",
             f"assert can_write({folder!r}) == False"]
    result = sandbox.verify(code, [sandbox.parse_test(t) for t in tests])
    assert result.passed == (True,) * 3, result.output
    assert sorted(os.listdir(folder)) == ["python", "secret.txt"]  # nothing changed outside


def test_check_names_the_modules_the_code_cannot_import(monkeypatch, capsys):
    monkeypatch.setattr(sandbox, "_checked", set())
    monkeypatch.setattr(sandbox, "PROBE_MODULES", ("typing", "no_such_module_here"))
    sandbox.check()
    err = capsys.readouterr().err
    assert "cannot import no_such_module_here (" in err and "typing" not in err.split("cannot import")[1].split("(")[0]


def test_the_filter_denies_new_namespaces_memfd_and_pidfd():
    """unshare(CLONE_NEWUSER), setns, memfd_create and pidfd_open end in EPERM from the filter,
    not in their own answers (success, EBADF)."""
    if os.uname().machine not in sandbox.SECCOMP:
        pytest.skip("no seccomp filter for this architecture")
    nr = {"x86_64": (272, 308, 319, 434), "aarch64": (97, 268, 279, 434)}[os.uname().machine]
    code = ("import ctypes, errno\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "def f(nr, *args):\n    ctypes.set_errno(0)\n    r = libc.syscall(nr, *args)\n"
            "    return 'denied' if r == -1 and ctypes.get_errno() == errno.EPERM else 'allowed'")
    tests = [f"assert f({nr[0]}, 0x10000000) == 'denied'", f"assert f({nr[1]}, -1, 0) == 'denied'",
             f"assert f({nr[2]}, b'x', 0) == 'denied'", f"assert f({nr[3]}, 1, 0) == 'denied'"]
    result = sandbox.verify(code, [sandbox.parse_test(t) for t in tests])
    assert result.passed == (True,) * 4, result.output


@as_root
def test_the_trainers_installed_packages_stay_hidden():
    """Where the interpreter lives in a private home (pyenv under /root here), its library is shown
    to the code again, but its site-packages is an empty, read-only folder."""
    purelib = sysconfig.get_paths()["purelib"]
    if not os.path.isdir(purelib) or searchable(purelib):
        pytest.skip("the interpreter's site-packages is not in a private home here")
    tests = [f"assert listing({purelib!r}) == []", f"assert can_write({purelib!r}) == False"]
    code = LOOK + "def can_write(path):\n    return write(path) == 'written'\nimport typing"
    result = sandbox.verify(code, [sandbox.parse_test(t) for t in tests])
    assert result.passed == (True,) * 2, result.output
