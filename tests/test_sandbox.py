"""sandbox.py: the executor under attack, its timeouts and parallel determinism, and the execution
verifiers on hand-written completions. Every attack is a completion whose test asserts that the
attack worked (`assert pwned`): a reward of 0 means it was contained, and each test also checks
from outside that nothing happened (files, processes, the listening socket) and that the run
ended within its time limit."""

import os
import shutil
import socket
import tempfile
import time

import pytest

from rlhf import sandbox

TIMEOUT = 2.0  # short limits keep these tests fast
SLACK = 3.0  # process start and kill on a loaded 2-core machine
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the uid drop and network namespace need root (sandbox.py docstring)")


def attack(code, timeout=TIMEOUT):
    """Run an attack whose test passes only if it worked: (reward, result, seconds)."""
    start = time.time()
    result = sandbox.run_batch([(code, ["assert pwned"])], timeout=timeout)[0]
    seconds = time.time() - start
    assert seconds < timeout + SLACK, f"the run took {seconds:.1f} s for a {timeout} s limit"
    return sum(result.passed) / len(result.passed), result, seconds


def sandbox_processes():
    """Pids of live processes owned by this process's sandbox uids (other pytest workers have their own)."""
    first = sandbox._uid(0)
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
        except (OSError, StopIteration):
            continue
        if first is not None and first <= uid < first + sandbox.MAX_WORKERS:
            pids.append(pid)
    return pids


# ---------------------------------------------------------------- attacks
def test_infinite_loop_times_out():
    reward, result, seconds = attack("while True:\n    pass\npwned = True")
    assert reward == 0 and result.status == "timeout" and seconds >= TIMEOUT - 0.1


def test_the_cpu_limit_reached_before_the_deadline_is_a_timeout(monkeypatch):
    """RLIMIT_CPU (SIGXCPU) is the wall limit's ceiling, and a busy loop can reach it first: still a
    timeout, never a crash (a tool's reply said "error: [exit code -24]" on an idle machine)."""
    limits = sandbox._limits
    monkeypatch.setattr(sandbox, "_limits", lambda timeout: {**limits(timeout), "RLIMIT_CPU": 1})
    result = sandbox.run_batch([("while True:\n    pass", ["assert False"])], timeout=30.0)[0]
    assert result.status == "timeout" and result.passed == (False,)


def test_ignored_signals_do_not_outlive_the_limit():
    code = ("import signal\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU, signal.SIGALRM):\n"
            "    signal.signal(s, signal.SIG_IGN)\nwhile True:\n    pass")
    reward, result, _ = attack(code)
    assert reward == 0 and result.status in ("timeout", "crashed")


def test_fork_bomb_cannot_fork():
    reward, result, _ = attack("import os\nwhile True:\n    os.fork()\npwned = True")
    assert reward == 0 and "BlockingIOError" in result.output  # RLIMIT_NPROC = 1
    assert sandbox_processes() == []


def test_spawning_a_shell_fails():
    reward, result, _ = attack("import os\npwned = os.system('echo hi') == 0")  # fork fails: -1
    assert reward == 0
    # exec needs no fork: the shell replaces the harness, keeps its limits and is killed at the deadline
    reward, result, _ = attack("import os\nos.execv('/bin/sh', ['sh', '-c', 'while :; do :; done'])")
    assert reward == 0 and result.status in ("timeout", "crashed")
    assert sandbox_processes() == []


def test_ten_gigabytes_raise_memory_error():
    reward, result, _ = attack("x = bytearray(10 * 2**30)\npwned = True")
    assert reward == 0 and "MemoryError" in result.output


def test_a_hundred_megabytes_of_output_are_capped():
    reward, result, _ = attack("print('x' * 100_000_000)\npwned = True")
    assert reward == 0 and "File too large" in result.output and len(result.output) < sandbox.OUTPUT_CHARS + 500


def test_exiting_early_does_not_pass_the_tests():
    for code in ("import os\npwned = True\nos._exit(0)", "import sys\npwned = True\nsys.exit(0)"):
        reward, result, _ = attack(code)
        assert reward == 0, code


def test_recursion_overflow():
    reward, result, _ = attack("def g(n):\n    return g(n + 1)\ng(0)\npwned = True")
    assert reward == 0 and "RecursionError" in result.output
    reward, result, _ = attack("import sys\nsys.setrecursionlimit(10**7)\ndef g(n):\n    return g(n + 1)\ng(0)\npwned = True")
    assert reward == 0  # it recurses until the time limit, MemoryError or a crash: the child ends, the trainer does not


def test_environment_variables_are_not_inherited(monkeypatch):
    monkeypatch.setenv("H26_SECRET_TOKEN", "s3cret")
    reward, result, _ = attack("import os\npwned = os.environ.get('H26_SECRET_TOKEN') == 's3cret'")
    assert reward == 0 and result.status == "ok"


@as_root
def test_the_trainers_environment_cannot_be_read_through_proc(monkeypatch):
    monkeypatch.setenv("H26_SECRET_TOKEN", "s3cret")
    reward, result, _ = attack(f"pwned = b's3cret' in open('/proc/{os.getpid()}/environ', 'rb').read()")
    assert reward == 0 and "PermissionError" in result.output


@pytest.fixture
def outside():
    """A folder outside /tmp (which the child's private tmpfs hides), readable and searchable by
    others as a project folder is; removed afterwards."""
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runs")
    if any(os.path.realpath(root).startswith(p + "/") for p in ("/tmp", "/var/tmp", "/dev/shm")):
        root = "/"  # a copy of the repository in /tmp (tests/mutants.py)
    os.makedirs(root, exist_ok=True)
    path = tempfile.mkdtemp(prefix="sandbox-victim-", dir=root)
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path)


DENIED = ("PermissionError", "Read-only file system")


@as_root
def test_writing_outside_the_working_dir_fails(outside):
    target = os.path.join(outside, "victim.txt")
    open(target, "w").write("intact")
    reward, result, _ = attack(f"open({target!r}, 'w').write('pwned')\npwned = True")
    assert reward == 0 and any(d in result.output for d in DENIED) and open(target).read() == "intact"
    reward, _, _ = attack(f"open({os.path.join(outside, 'new.txt')!r}, 'w').write('pwned')\npwned = True")
    assert reward == 0 and not os.path.exists(os.path.join(outside, "new.txt"))
    os.chmod(outside, 0o777)  # world-writable, as /tmp is: every mount is read-only for the code
    reward, result, _ = attack(f"open({os.path.join(outside, 'new.txt')!r}, 'w').write('pwned')\npwned = True")
    assert reward == 0 and "Read-only file system" in result.output and not os.path.exists(os.path.join(outside, "new.txt"))


@as_root
def test_without_mount_setattr_every_mount_is_remounted_read_only(outside, monkeypatch):
    """Kernels before 5.12 (no mount_setattr): the harness remounts each mount read-only instead."""
    monkeypatch.setattr(sandbox, "HARNESS", sandbox.HARNESS.replace("libc.syscall(442,", "libc.syscall(-1,"))
    os.chmod(outside, 0o777)
    code = f"open('/tmp/scratch', 'w').write('x')\nopen({os.path.join(outside, 'new.txt')!r}, 'w').write('pwned')\npwned = True"
    reward, result, _ = attack(code)
    assert reward == 0 and "Read-only file system" in result.output and not os.path.exists(os.path.join(outside, "new.txt"))


@as_root
def test_deleting_files_fails(outside):
    victim = os.path.join(outside, "checkpoint.bin")
    open(victim, "wb").write(b"weights")
    reward, result, _ = attack(f"import os, shutil\nos.remove({victim!r})\npwned = True")
    assert reward == 0 and open(victim, "rb").read() == b"weights"
    reward, _, _ = attack(f"import shutil\nshutil.rmtree({outside!r})\npwned = True")
    assert reward == 0 and os.path.exists(victim)


def test_the_working_dir_is_fresh_and_removed(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the sandbox's folders go here: another test worker's do not
    code = "import os\nassert os.listdir('.') == [], os.listdir('.')\nopen('scratch.txt', 'w').write('x')\npwned = False"
    reward, result, _ = attack(code)
    assert result.status == "ok" and os.listdir(tmp_path) == []


@as_root
def test_signals_cannot_reach_the_trainer_or_other_runs():
    innocent = ("def f(x):\n    return x + 1", ["assert f(1) == 2"])
    hostile = (f"import os, signal\nos.kill(-1, signal.SIGKILL)\nos.kill({os.getpid()}, signal.SIGKILL)\npwned = True", ["assert pwned"])
    results = sandbox.run_batch([innocent, hostile, innocent, hostile, innocent], workers=3)
    assert [r.passed for r in results] == [(True,), (False,), (True,), (False,), (True,)]  # and pytest is alive


@as_root
def test_no_network(monkeypatch):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    reward, result, _ = attack(f"import socket\ns = socket.socket()\ns.settimeout(1)\ns.connect(('127.0.0.1', {port}))\npwned = True")
    assert reward == 0 and "Network is unreachable" in result.output  # no interface is up in the new namespace
    with pytest.raises(socket.timeout):
        server.accept()  # nobody knocked
    server.close()


# ---------------------------------------------------------------- timing and the pool
def test_a_slow_test_times_out_and_fails_the_rest():
    result = sandbox.run("import time\ndef f(x):\n    return x", ["assert f(1) == 1", "time.sleep(60)", "assert f(2) == 2"],
                         timeout=1.0)
    assert result.status == "timeout" and result.passed == (False, False, False)


def test_results_do_not_depend_on_the_pool_size():
    jobs = [(f"def f(x):\n    return x * {k % 3}", [f"assert f(2) == {2 * (k % 2)}", "assert f(0) == 0"]) for k in range(8)]
    jobs += [("def f(x) return", ["assert f(1) == 1"]), ("raise SystemExit(3)", ["assert True"]),
             ("import os\nos._exit(1)", ["assert True"]), ("import os\nos.fork()", ["assert True"])]
    serial = sandbox.run_batch(jobs, workers=1)
    parallel = sandbox.run_batch(jobs[::-1], workers=4)[::-1]
    assert [r.passed for r in serial] == [r.passed for r in parallel]
    assert [r.status for r in serial] == [r.status for r in parallel]
    assert serial[0].passed == (True, True) and serial[2].passed == (False, True) and serial[8].status == "error"


# ---------------------------------------------------------------- the verifiers
SQUARE_TESTS = ["assert f(2) == 4", "assert f(-3) == 9", "assert f(0) == 0", "assert f(5) == 25"]


@pytest.mark.parametrize("completion, fraction", [
    ("def f(x):\n    return x * x", 1.0),  # no fence: the whole text
    ("Here it is:\n```python\ndef f(x):\n    return x ** 2\n```\nDone.", 1.0),  # fenced
    ("```py\ndef f(x):\n    return x * x\n```", 1.0),
    ("Try:\n```\ndef f(x):\n    return 0\n```\nbetter:\n```python\ndef f(x):\n    return abs(x) * abs(x)\n```", 1.0),  # last python block
    ("def f(x):\n    return x + x", 0.5),  # wrong: right at 0 and 2 only
    ("def f(x):\n    return x *", 0.0),  # malformed
    ("```python\ndef f(x):\n    return x * x", 0.0),  # a fence never closed: the text, fence included, does not compile
    ("The answer is x squared.", 0.0),  # prose
    ("", 0.0),
])
def test_exec_tests_on_hand_written_completions(completion, fraction):
    assert sandbox.exec_tests(prompts=["p"], completions=[completion], tests=[SQUARE_TESTS]) == [fraction]
    assert sandbox.exec_tests_strict(prompts=["p"], completions=[completion], tests=[SQUARE_TESTS]) == [float(fraction == 1.0)]


def test_exec_tests_takes_both_calling_contracts_and_conversations():
    conversation = [{"role": "assistant", "content": "```python\ndef f(x):\n    return x * x\n```"}]
    # TRL's keywords (with completion_ids and other columns), and this project's positional call
    assert sandbox.exec_tests(prompts=["p"], completions=[conversation], completion_ids=[[1]], tests=[SQUARE_TESTS],
                              other=["x"]) == [1.0]
    assert sandbox.exec_tests(["p", "p"], ["def f(x):\n    return 4", conversation], tests=[SQUARE_TESTS, "assert f(3) == 9"]) == [0.25, 1.0]


def test_exec_tests_harness_errors_are_one_sentence():
    with pytest.raises(ValueError, match="no `tests` column"):
        sandbox.exec_tests(prompts=["p"], completions=["x = 1"])
    with pytest.raises(ValueError, match="row 1 of the `tests` column"):
        sandbox.exec_tests(prompts=["p", "q"], completions=["x = 1", "x = 1"], tests=[["assert f(1) == 1"], [3]])
    with pytest.raises(ValueError, match="non-empty list"):
        sandbox.exec_tests(prompts=["p"], completions=["x = 1"], tests=[[]])


def test_the_verifiers_are_reward_fn_names():
    import common

    assert common.load_reward_fn("exec_tests") is sandbox.exec_tests
    assert common.load_reward_fn("exec_tests_strict") is sandbox.exec_tests_strict
    rewards = common.call_reward_fns([sandbox.exec_tests, sandbox.exec_tests_strict], ["p", "q"],
                                     ["def f(x):\n    return x * x", "oops("], columns={"tests": [SQUARE_TESTS, SQUARE_TESTS]})
    assert rewards.tolist() == [[1.0, 1.0], [0.0, 0.0]]  # (completions, functions), called by keyword as TRL does


def test_the_digit_limit_is_restored_when_threads_overlap():
    """verify lifts Python's int-to-text digit limit from a pool of threads: while any of them is
    inside, a huge int prints; once all have left, the trainer's limit is back. Threads enter one
    after the other and leave first-in first-out, so the last to leave entered while the limit was
    already lifted (a per-thread save and restore leaves it lifted)."""
    import sys
    import threading

    if not hasattr(sys, "get_int_max_str_digits"):
        pytest.skip("this Python has no digit limit")
    limit, n = sys.get_int_max_str_digits(), 8
    entered, left = [threading.Event() for _ in range(n)], [threading.Event() for _ in range(n)]
    failures = []

    def work(i):
        if i:
            entered[i - 1].wait(10)
        with sandbox._any_digits():
            entered[i].set()
            entered[n - 1].wait(10)  # every thread inside
            try:
                repr(10 ** 5000)
            except ValueError as e:
                failures.append(e)
            if i:
                left[i - 1].wait(10)
        left[i].set()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures and sys.get_int_max_str_digits() == limit
