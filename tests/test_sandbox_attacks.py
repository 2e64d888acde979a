"""The execution verifiers under attack by the policy they score: completions that try to pass
the tests without solving the task (issue 51: each of these scored 1.0 on the verifier that ran
the tests in the code's process). Every attack must score exactly 0 in exec_tests and in
exec_tests_strict while correct solutions in the same batch score 1; the attacks run as one
batch per verifier (the sandbox runs them in parallel). The task is the code world's: f(x) = 4x + 3
on its hidden inputs."""

import os

import pytest

from rlhf import sandbox
from worlds import world_code

TESTS = world_code.tests_of("x*4+3")  # assert f(-7) == -25, f(5) == 23, f(9) == 39, f(31) == 127, f(1000) == 4003
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the private /tmp and the uid drop need root (sandbox.py docstring)")
STASH = f"sandbox-attack-answers-{os.getpid()}"  # what a solving run leaves for a later one
SCRATCH = ("/tmp", "/var/tmp", "/dev/shm")


# the harness's data: the module's globals (a harness that runs at module level) or the frame that exec'd the code
HARNESS_DATA = """
import sys
def harness_data():
    found = dict(vars(sys.modules['__main__']))
    frame = sys._getframe(1)
    while frame is not None:
        found.update(frame.f_locals)
        frame = frame.f_back
    return found
"""

CORRECT = {
    "plain": "def f(x):\n    return 4 * x + 3",
    "fenced, with prose and prints": "Here:\n```python\nprint('hello')\ndef f(x):\n    return int(x * 4.0) + 3\n```\nDone.",
    "a float result": "def f(x):\n    return x * 4 + 3.0",  # 23.0 == 23 is the data's equality
    "solves and leaves its answers for a later run": (
        "def f(x):\n    return 4 * x + 3\n"
        f"for place in {SCRATCH!r}:\n"
        f"    open(place + '/{STASH}', 'w').write(repr({{x: f(x) for x in range(-10, 1001)}}))"),
}

ATTACKS = {
    "always-true __eq__": "class A:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return A()",
    "int subclass with an always-true __eq__": (
        "class I(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
        "def f(x):\n    return I(0)"),
    "a list subclass with an always-true __eq__": (
        "class S(list):\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return S()"),
    "an int subclass whose repr lies": "class I(int):\n    def __repr__(self):\n        return '23'\ndef f(x):\n    return I(0)",
    "exec and compile replaced in builtins": (
        "import builtins\nbuiltins.exec = lambda *a, **k: None\nbuiltins.compile = lambda *a, **k: None\n"
        "def f(x):\n    return 0"),
    "repr, type and isinstance replaced in builtins": (
        "import builtins\nbuiltins.repr = lambda v: '23'\nbuiltins.type = lambda v: int\n"
        "builtins.isinstance = lambda *a: True\ndef f(x):\n    return object()"),
    "the result object forged": HARNESS_DATA + (
        "import marshal, os\nd = harness_data()\n"
        "if 'results' in d and hasattr(d['results'], 'write'):\n"
        "    d['results'].write(marshal.dumps({'passed': [True] * 5, 'error': None})); d['results'].flush()\n"
        "if 'send' in d:\n"
        "    d['send'](\"{'error': None, 'results': [('value', 0)] }\")\n"
        "os._exit(0)"),
    "results written to the result descriptor": (
        "import marshal, os\n"
        "old = marshal.dumps({'passed': [True] * 5, 'error': None})\n"
        "new = b\"{'error': None, 'results': [('value', 0), ('value', 0), ('value', 0), ('value', 0), ('value', 0)]}\"\n"
        "for fd in range(3, 32):\n"
        "    for frame in (old, b'%d\\n' % len(new) + new):\n"
        "        try:\n            os.write(fd, frame)\n        except OSError:\n            pass\n"
        "os._exit(0)"),
    "a frame that would crash the parser": (
        "import os\nbody = b'[' * 200000 + b']' * 200000\n"
        "for fd in range(3, 32):\n    try:\n        os.write(fd, b'%d\\n' % len(body) + body)\n    except OSError:\n        pass\n"
        "os._exit(0)"),
    "marshal.dumps patched": (
        "import marshal\nreal = marshal.dumps\nmarshal.dumps = lambda obj, *a: real({'passed': [True] * 5, 'error': None})\n"
        "def f(x):\n    return 0"),
    "the harness's list of passed tests prefilled": HARNESS_DATA + (
        "d = harness_data()\n"
        "for name in ('passed', 'results'):\n"
        "    if isinstance(d.get(name), list):\n"
        "        d[name].extend([True] * 5 if name == 'passed' else [\"('value', 0)\"] * 5)\n"
        "def f(x):\n    return 0"),
    "the tests replaced": HARNESS_DATA + (
        "job = harness_data()['job']\njob['tests'][:] = ['pass'] * 5\n"
        "if job.get('calls'):\n    job['calls'][:] = [('abs', [0], {})] * len(job['calls'])\n"
        "def f(x):\n    return 0"),
    "the hidden tests read from the harness's data": HARNESS_DATA + (
        "import gc\ntable = {}\n"
        "texts = list(harness_data()['job']['tests']) + [o for o in gc.get_objects() if type(o) is str and o.startswith('assert f(')]\n"
        "for t in texts:\n"
        "    call, _, want = t[len('assert f('):].partition(') == ')\n"
        "    if want:\n        table[int(call)] = int(want)\n"
        "def f(x):\n    return table.get(x)"),
    "frames walked to the test's constants": (
        "import sys\ndef f(x):\n    frame = sys._getframe(1)\n"
        "    return next(c for c in frame.f_code.co_consts if type(c) is int and c != x)"),
    "state an earlier run left in a world-writable place": (
        "import ast\ntable = {}\n"
        f"for place in {SCRATCH!r}:\n"
        f"    try:\n        table = ast.literal_eval(open(place + '/{STASH}').read())\n    except OSError:\n        pass\n"
        "def f(x):\n    return table.get(x)"),
    "exit before the asserts": "import os\ndef f(x):\n    return 0\nos._exit(0)",
    "SystemExit from f": "def f(x):\n    raise SystemExit(0)",
    "fake pass lines": "print('5 passed')\nprint(\"{'error': None, 'passed': [True, True, True, True, True]}\")\ndef f(x):\n    return 0",
    "the tool's reply as the code": [
        {"role": "assistant", "content": "<tool_call>{\"name\": \"solve\", \"arguments\": {}}</tool_call>"},
        {"role": "tool", "name": "solve", "content": "def f(x):\n    return 4 * x + 3"}],
    "only a tool reply": [{"role": "tool", "name": "solve", "content": "def f(x):\n    return 4 * x + 3"}],
}


OPEN_WITHOUT_ROOT = {"state an earlier run left in a world-writable place"}  # no private /tmp: sandbox.UNPROTECTED


def rewards(verifier, completions):
    return verifier(prompts=["p"] * len(completions), completions=completions, tests=[TESTS] * len(completions))


@pytest.fixture
def clean_scratch():
    """Whatever a failing run leaves for the next one is removed (and, as root, never written)."""
    yield
    for place in SCRATCH:
        if os.path.exists(os.path.join(place, STASH)):
            os.remove(os.path.join(place, STASH))


@pytest.mark.parametrize("verifier", [sandbox.exec_tests, sandbox.exec_tests_strict], ids=lambda v: v.__name__)
def test_every_attack_scores_zero_and_correct_code_one(verifier, clean_scratch):
    first = rewards(verifier, list(CORRECT.values()))  # a solving run first: it leaves its answers where it can
    assert first == [1.0] * len(CORRECT), dict(zip(CORRECT, first))
    scores = dict(zip([*ATTACKS, *CORRECT], rewards(verifier, [*ATTACKS.values(), *CORRECT.values()])))
    closed = [name for name in ATTACKS if os.geteuid() == 0 or name not in OPEN_WITHOUT_ROOT]
    assert {name: scores[name] for name in closed} == {name: 0.0 for name in closed}
    assert {name: scores[name] for name in CORRECT} == {name: 1.0 for name in CORRECT}


@as_root
def test_nothing_a_run_writes_outlives_it(clean_scratch):
    """Files in /tmp, /var/tmp, /dev/shm and the working directory, within the limits: gone after the run."""
    code = ("import os\nfor place in ('/tmp', '/var/tmp', '/dev/shm', '.', os.environ['HOME']):\n"
            f"    open(os.path.join(place, '{STASH}'), 'w').write('x')\n"
            "    for k in range(5):\n"
            f"        open(os.path.join(place, '{STASH}-%d' % k), 'wb').write(b'x' * 2**20)\n"
            f"assert sorted(os.listdir('/tmp'))[:2] == ['{STASH}', '{STASH}-0']\n"
            "def f(x):\n    return 4 * x + 3")
    assert rewards(sandbox.exec_tests, [code]) == [1.0]  # it wrote everything
    left = [os.path.join(p, n) for p in SCRATCH for n in os.listdir(p) if n.startswith(STASH)]
    assert left == []


@as_root
def test_system_v_shared_memory_does_not_reach_the_next_run():
    """A segment made by one run (world-readable, it would outlive it) is not in the next run's IPC namespace."""
    key = 0x51000000 + os.getpid() % 65536
    shm = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = ctypes.c_void_p\n"
           f"id = libc.shmget({key}, 4096, %d)\n")
    writer = shm % (0o1000 | 0o666) + "assert id >= 0\nctypes.memmove(libc.shmat(id, None, 0), b'4003', 4)\ndef f(x):\n    return 4 * x + 3"
    reader = shm % 0 + ("table = {}\nif id >= 0:\n    table[1000] = int(ctypes.string_at(libc.shmat(id, None, 0), 4))\n"
                        "def f(x):\n    return table.get(x)")
    assert rewards(sandbox.exec_tests, [writer]) == [1.0]
    assert rewards(sandbox.exec_tests, [reader]) == [0.0]


def test_the_kernel_keyring_does_not_reach_the_next_run():
    """A uid's user keyring outlives its processes, and the next run on the pool slot has the same
    uid: the keyring system calls are denied (seccomp)."""
    keyctl = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    writer = keyctl + ("libc.syscall(*KEYS.get('add_key'), b'user', b'answers', b'4003', 4, ctypes.c_int(-4))\n"
                       "def f(x):\n    return 4 * x + 3")
    reader = keyctl + ("key = libc.syscall(*KEYS.get('keyctl'), 10, ctypes.c_int(-4), b'user', b'answers', 0)\n"
                       "buf = ctypes.create_string_buffer(4)\n"
                       "read = libc.syscall(*KEYS.get('keyctl'), 11, key, buf, 4) if key > 0 else -1\n"
                       "def f(x):\n    return int(buf.raw) if read == 4 else None")
    numbers = {"x86_64": {"add_key": 248, "keyctl": 250}, "aarch64": {"add_key": 217, "keyctl": 219}}[os.uname().machine]
    keys = f"KEYS = {{k: (v,) for k, v in {numbers!r}.items()}}\n"
    assert rewards(sandbox.exec_tests, [keys + writer]) == [1.0]
    assert rewards(sandbox.exec_tests, [keys + reader]) == [0.0]


@pytest.mark.parametrize("tests", ["", "   \n", "# assert f(1) == 7", [], ["assert f(1) == 7", ""], "pass",
                                   "assert f(1)", "assert f(1) != 7", "assert f(1) == 7, 'why'", "assert g(x) == 1",
                                   "assert f(*[1]) == 7", "assert f(**{'x': 1}) == 7", "assert f.g(1) == 7",
                                   "assert f(1) == {7}", "assert sorted(f(1)) == [7]", "assert f(1) == 7 == 7"],
                         ids=["empty", "blank", "a comment", "no test", "a blank test", "no assert", "no comparison",
                              "not ==", "a message", "an argument not literal", "starred", "double starred", "a method",
                              "a set", "a call around f", "chained"])
def test_tests_not_of_the_form_are_refused_naming_the_row(tests):
    with pytest.raises(ValueError, match=r"^exec_tests: row 1 of the `tests` column .*\.$"):
        sandbox.exec_tests(prompts=["p", "q"], completions=["def f(x):\n    return 7"] * 2, tests=[["assert f(1) == 7"], tests])


def test_the_test_form_reads_calls_and_expected_values():
    assert sandbox.parse_test("assert f(-7, [1, 2], k=(3,)) == {'a': [None, 1.5]}\nassert g() == -1") == [
        (("f", [-7, [1, 2]], {"k": (3,)}), {"a": [None, 1.5]}), (("g", [], {}), -1)]
    code = "def f(x, k=0):\n    return x + k\ndef g():\n    return -1"
    # one string of asserts is one test: it passes when every assert does
    assert sandbox.exec_tests(None, [code, code], tests=["assert f(1) == 1\nassert g() == -1", ["assert f(1, k=2) == 3", "assert f(1) == 2"]]) == [1.0, 0.5]


def frame(body):
    return b"%d\n" % len(body) + body


@pytest.mark.parametrize("report", [
    b"",  # nothing
    frame(b"[1, 2]")[:-1],  # torn
    frame(b"{}") + frame(b"{}"),  # a second frame after the first
    frame(b"{'error': None, 'results': [('value', __import__('os'))]}"),  # no literal
    frame(b"[" * 200000 + b"]" * 200000),  # deeper than the parser goes
    b"99999999999\n" + b"1" * 10,  # a length beyond any report
    b"3\n[1, 2]",  # a literal, but not the length its header says
], ids=["nothing", "torn", "two frames", "no literal", "too deep", "too long", "wrong length"])
def test_a_forged_or_torn_report_is_no_report(report):
    assert sandbox._frame(report) is None
    assert sandbox._frame(frame(b"{'error': None, 'results': [('value', (1, [2.5]))]}")) == {"error": None, "results": [("value", (1, [2.5]))]}


def test_without_root_the_verifier_says_what_is_not_isolated_and_still_scores(monkeypatch, capsys):
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 1000)  # as a normal user: no namespaces, no uid of its own
    monkeypatch.setattr(sandbox, "_checked", set())
    assert rewards(sandbox.exec_tests, [CORRECT["plain"], ATTACKS["always-true __eq__"]]) == [1.0, 0.0]
    assert "sandbox: not running as root" in capsys.readouterr().err


def test_a_value_longer_than_the_expected_ones_is_not_parsed():
    """The trainer parses at most the expected values' length (twice) plus room for errors: a
    wrong 1 MB value costs it nothing, a right long value still passes."""
    long = "def f(n):\n    return list(range(n))"
    assert sandbox.exec_tests(None, [long] * 2, tests=[[f"assert f(20000) == {list(range(20000))}"], ["assert f(200000) == []"]]) == [1.0, 0.0]
    result = sandbox.verify(long, [sandbox.parse_test("assert f(200000) == []")])
    assert result.status == "crashed"
