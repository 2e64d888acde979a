"""sandbox.py: run generated Python against unit tests in a separate, limited process, and the
execution verifiers built on it (`--reward_fn exec_tests`, `exec_tests_strict`).

Imports nothing from the project, so it can be read, tested and reused alone.

How one completion runs (`run`):
- a fresh `python -I -S` process (isolated mode: no PYTHON* variables, the working directory not
  on sys.path; -S: no site-packages, so the code and tests import the standard library only, and
  the interpreter starts in ~15 ms instead of ~75 ms) in its own session and process group,
  with a minimal environment: PATH, HOME (the working directory), LANG and one-thread settings
  for numeric libraries; nothing of the trainer's environment (tokens, keys) is passed;
- a fresh, empty temporary working directory, removed afterwards;
- the job (code and tests) arrives on stdin and is read before the code runs, so the code cannot
  read its tests from a file; the code's stdout and stderr go to a file outside the working
  directory (capped by the file-size limit; the first OUTPUT_CHARS characters are kept for
  diagnosis), the results go back through a separate descriptor to another such file;
- before the code runs, the harness in the child (HARNESS below) sets, for itself and the code:
  RLIMIT_CPU (CPU seconds; SIGXCPU then SIGKILL), RLIMIT_AS (address space: a large allocation
  raises MemoryError), RLIMIT_FSIZE (largest file it may write), RLIMIT_NOFILE (open files) and
  RLIMIT_NPROC = 1 (no new process or thread: fork, subprocess and threads fail);
- when the trainer runs as root (the usual container), the harness also enters a new network
  namespace (unshare(CLONE_NEWNET) through libc: no interface but a down loopback, so no socket
  can reach anything) and then drops to an unprivileged uid of its own (`_uid`: one per pool slot
  and per trainer process, so two ranks or two trainers on a machine rarely share one), one uid per
  concurrent run: RLIMIT_NPROC is enforced for it (root ignores it), it can read or change only
  world-readable / world-writable files, and it can signal no process but itself (not the
  trainer, not another completion's run);
- the parent waits at most `timeout` wall-clock seconds, then kills the whole process group
  (SIGKILL), always, also after a normal exit.
Each test is run in the code's namespace after the code, in order; a test passes when it raises
nothing. An error in the code (syntax, exception, exit, crash, timeout, limit) fails the tests it
did not get to pass: a reward of 0, never an exception in the trainer.

What it does NOT protect against (it is not a container; use one, or gVisor / a VM, for code you
would not run on your own machine):
- without root, the code runs as the trainer's own user: it can read, write and delete whatever
  that user can (including the project and checkpoints) and signal the trainer, and the network
  is not isolated (RLIMIT_NPROC still stops it from starting processes);
- as root, the unprivileged uid can still read world-readable files (e.g. /etc, the project's
  source) and write world-writable ones (e.g. /tmp, within RLIMIT_FSIZE per file); there is no
  mount namespace, seccomp filter or cgroup, so kernel exploits, disk filling by many small files
  in /tmp within the time limit, and CPU/memory contention with the trainer are not prevented;
- the tests run in the same interpreter as the code: code written to subvert the harness (e.g.
  redefining what the tests call, or writing fake results to the results descriptor) can fake
  passing; rewards from adversarial models need tests run outside the code's process.

Parallel runs (`run_batch`): a thread pool of `workers` (default: the cores this process may
use) starts the processes; identical (code, tests) pairs of a batch run once. Each run is
independent, so results do not depend on the pool size or on timing, except that a run that
exceeds its time limit (more likely on a loaded machine) fails.

The verifiers (`exec_tests`, `exec_tests_strict`) follow TRL's reward-function contract,
fn(prompts=, completions=, **columns): completions are strings or conversations (the last
message's content), the tests come from the dataset column `tests` (a list of Python statements
such as ["assert f(2) == 7", "assert f(-1) == -2"], or one string of statements, which counts as
one test), and the code is extracted from the completion by `extract_code`.
"""

import marshal
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

# ---------------------------------------------------------------- limits (per completion)
TIMEOUT = 5.0  # wall-clock seconds for the code and all its tests; RLIMIT_CPU is its ceiling
MEMORY_MB = 1024  # RLIMIT_AS: address space of the child, interpreter included
FILE_SIZE_MB = 4  # RLIMIT_FSIZE: the largest file the child may write (its captured output too)
OPEN_FILES = 32  # RLIMIT_NOFILE
OUTPUT_CHARS = 2000  # characters of the code's output kept in Result.output
UID_BASE, UID_RANGE = 61000, 4096  # as root, runs take uids in UID_BASE..UID_BASE+UID_RANGE-1 (no user may hold one)
MAX_WORKERS = 64  # pool slots per process
PRELOAD = ("math", "itertools", "heapq", "bisect")  # see _stdlib_readable; cheap ones: each costs every run start-up time
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
       "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # + HOME = the working directory


class SandboxError(RuntimeError):
    """The sandbox itself cannot run (not the code it runs): the message says what to fix."""


@dataclass(frozen=True)
class Result:
    passed: tuple  # one bool per test
    status: str  # ok | error (the code raised or did not compile) | timeout | crashed (no result: killed, exit, limit)
    output: str = ""  # the start of what the code printed, and the error


# ---------------------------------------------------------------- the child
# Runs in the fresh interpreter. Everything before `exec` is trusted set-up; after it, the code.
HARNESS = r"""
import marshal, os, resource, sys
job = marshal.loads(sys.stdin.buffer.read())
results = os.fdopen(os.dup(1), "wb")  # the results descriptor; the code's prints go to the output file
os.dup2(2, 1)
if job["uid"] is not None:  # root: no network, then an unprivileged uid of our own
    import ctypes
    if ctypes.CDLL(None, use_errno=True).unshare(0x40000000) != 0:  # CLONE_NEWNET
        results.write(marshal.dumps({"setup_error": "unshare(CLONE_NEWNET): " + os.strerror(ctypes.get_errno())}))
        results.flush(); os._exit(3)
    for name in job["preload"]:  # modules the code may import when the uid cannot read the interpreter's files
        __import__(name)
    os.setgroups([]); os.setgid(job["uid"]); os.setuid(job["uid"])
for name, value in job["limits"].items():
    resource.setrlimit(getattr(resource, name), (value, value + (name == "RLIMIT_CPU")))  # CPU: SIGXCPU, 1 s later SIGKILL
passed, error = [], None
namespace = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    exec(compile(job["code"], "<completion>", "exec"), namespace)
except BaseException as e:  # SystemExit and KeyboardInterrupt included: nothing the code does stops the report
    error = "code: " + type(e).__name__ + ": " + str(e)[:300]
if error is None:
    for test in job["tests"]:
        try:
            exec(compile(test, "<test>", "exec"), namespace)
            passed.append(True)
        except BaseException as e:
            passed.append(False)
            error = error or "test: " + type(e).__name__ + ": " + str(e)[:300]
try:
    sys.stdout.flush()  # what the code printed, for Result.output
except BaseException:  # the code closed or replaced sys.stdout: its output is not ours to report
    pass
results.write(marshal.dumps({"passed": passed, "error": error}))
results.flush()
os._exit(0)
"""


def _stdlib_readable():
    """Whether any user can read the standard library (every directory above it searchable by
    others). Not, e.g., for a python installed under /root: then the child imports PRELOAD
    before it drops to the unprivileged uid, and other modules fail to import."""
    path = os.path.dirname(os.__file__)
    while True:
        if not os.stat(path).st_mode & 0o005 == 0o005:
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path = parent


def _child_env(workdir):
    return {**ENV, "HOME": workdir}


def _limits(timeout):
    mb = 1 << 20
    return {"RLIMIT_CPU": max(1, int(timeout + 0.999)), "RLIMIT_AS": MEMORY_MB * mb,
            "RLIMIT_FSIZE": FILE_SIZE_MB * mb, "RLIMIT_NOFILE": OPEN_FILES, "RLIMIT_NPROC": 1}


def _uid(slot):
    """The uid of pool slot `slot` when running as root (None otherwise: the code runs as us):
    a block of MAX_WORKERS uids per process, chosen by its pid, so concurrent processes (torchrun
    ranks, two trainers) share a block only when their pids agree modulo 64."""
    block = os.getpid() % (UID_RANGE // MAX_WORKERS)
    return UID_BASE + block * MAX_WORKERS + slot if os.geteuid() == 0 else None


def _spawn(code, tests, timeout, slot):
    """One run: (status, passed, output, parsed results). The working directory never outlives it."""
    workdir = tempfile.mkdtemp(prefix="sandbox-")  # the code's, empty
    private = tempfile.mkdtemp(prefix="sandbox-io-")  # ours (mode 700): its output and results files
    try:
        uid = _uid(slot)
        if uid is not None:
            os.chown(workdir, uid, uid)
        job = marshal.dumps({"code": code, "tests": list(tests), "uid": uid, "limits": _limits(timeout),
                             "preload": PRELOAD if uid is not None and not _stdlib_readable() else ()})
        out_path, res_path = os.path.join(private, "output"), os.path.join(private, "result")
        with open(out_path, "wb") as out, open(res_path, "wb") as res:
            try:
                proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", HARNESS], stdin=subprocess.PIPE, stdout=res,
                                        stderr=out, cwd=workdir, env=_child_env(workdir), start_new_session=True,
                                        close_fds=True)
            except OSError as e:
                raise SandboxError(f"sandbox: cannot start {sys.executable} ({e}); the machine is out of processes or memory.") from e
            timed_out = False
            try:
                proc.communicate(job, timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the whole group, even after a normal exit
                except ProcessLookupError:
                    pass
                proc.wait()
        with open(out_path, "rb") as f:
            output = f.read(OUTPUT_CHARS).decode("utf-8", "replace")
        with open(res_path, "rb") as f:
            raw = f.read(1 << 16)  # results are small; a larger file is the code's doing
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # as root this removes whatever the code left
        shutil.rmtree(private, ignore_errors=True)
    try:
        report = marshal.loads(raw) if raw else None
    except (ValueError, EOFError, TypeError):  # torn or forged: no result
        report = None
    # RLIMIT_CPU is the wall limit's ceiling: a busy loop can reach it (SIGXCPU) just before the deadline
    if timed_out or proc.returncode == -signal.SIGXCPU:
        return "timeout", (), output, report
    if not isinstance(report, dict):
        return "crashed", (), output + f"\n[exit code {proc.returncode}]", report
    passed = tuple(bool(p) for p in report.get("passed", ()))
    if report.get("error"):
        output += "\n" + str(report["error"])
    return ("error" if str(report.get("error") or "").startswith("code:") else "ok"), passed, output, report


def run(code, tests, timeout=TIMEOUT, slot=0):
    """Run `code`, then each of `tests` (Python statements), in a fresh limited process -> Result."""
    status, passed, output, _ = _spawn(code, tests, timeout, slot)
    passed = tuple(passed[:len(tests)]) + (False,) * (len(tests) - len(passed))  # unreached tests fail
    return Result(passed, status, output)


# ---------------------------------------------------------------- a batch, in parallel
_checked = set()  # (euid, executable) pairs whose set-up worked
_check_lock = threading.Lock()


def check():
    """Run one trivial job and raise SandboxError if it does not pass: a problem of the sandbox
    (no python, unshare refused, setuid refused) is told once, up front, and never mistaken for
    a wrong completion. Done once per process."""
    key = (os.geteuid(), sys.executable)
    with _check_lock:
        if key in _checked:
            return
        if os.geteuid() == 0:
            import pwd
            taken = [p.pw_name for p in pwd.getpwall() if UID_BASE <= p.pw_uid < UID_BASE + UID_RANGE]
            if taken:
                raise SandboxError(f"sandbox: uids {UID_BASE}..{UID_BASE + UID_RANGE - 1} must belong to no user, but "
                                   f"{', '.join(taken)} holds one; set sandbox.UID_BASE to a free range.")
        status, passed, output, report = _spawn("x = 1", ["assert x == 1"], 30.0, 0)
        if passed != (True,):
            why = report.get("setup_error") if isinstance(report, dict) and report.get("setup_error") else f"status {status}: {output.strip()[:300]}"
            raise SandboxError(f"sandbox: a trivial job failed ({why}); the sandbox cannot run here "
                               "(as root it needs unshare(CLONE_NEWNET) and setuid: run the container with CAP_SYS_ADMIN, or as a normal user).")
        _checked.add(key)


def default_workers():
    """The cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def run_batch(jobs, workers=None, timeout=TIMEOUT):
    """Results of [(code, tests), ...], in order, `workers` runs at a time; duplicates run once."""
    check()
    workers = min(MAX_WORKERS, max(1, workers or default_workers()))
    unique = list(dict.fromkeys((code, tuple(tests)) for code, tests in jobs))
    slots = list(range(workers))  # a run takes a slot (its uid) and gives it back: never two runs on one uid
    lock = threading.Lock()

    def one(job):
        with lock:
            slot = slots.pop()
        try:
            return run(job[0], job[1], timeout, slot)
        finally:
            with lock:
                slots.append(slot)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = dict(zip(unique, pool.map(one, unique)))
    return [results[code, tuple(tests)] for code, tests in jobs]


# ---------------------------------------------------------------- the verifiers
_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(text):
    """The code in a completion: the last fenced block marked python (```python or ```py), else
    the last fenced block of any kind, else the whole text. A fence never closed is not a block
    (the whole text, fence included, then fails to compile: reward 0)."""
    blocks = _FENCE.findall(text)
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    if python:
        return python[-1]
    return blocks[-1][1] if blocks else text


def _completion_text(completion):
    return completion if isinstance(completion, str) else completion[-1]["content"]  # TRL: text or messages


def _tests_of(row, tests):
    if isinstance(tests, str):
        tests = [tests]
    if not isinstance(tests, (list, tuple)) or not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError(f"exec_tests: row {row} of the `tests` column holds {str(tests)[:100]!r}; expected a non-empty "
                         "list of Python statements such as [\"assert f(2) == 7\"] (or one string of statements).")
    return tests


def pass_fractions(completions, tests):
    """The fraction of its row's tests each completion passes."""
    if tests is None:
        raise ValueError("exec_tests: the dataset has no `tests` column; add one (a list of Python statements "
                         "such as [\"assert f(2) == 7\"] per row) or use another --reward_fn.")
    jobs = [(extract_code(_completion_text(c)), _tests_of(i, t)) for i, (c, t) in enumerate(zip(completions, tests))]
    return [sum(r.passed) / len(r.passed) for r in run_batch(jobs)]


def exec_tests(prompts=None, completions=None, tests=None, **columns):
    """Fraction of the row's `tests` that the completion's code passes (0.0 on any error)."""
    return pass_fractions(completions, tests)


def exec_tests_strict(prompts=None, completions=None, tests=None, **columns):
    """1.0 when the completion's code passes every test of its row, else 0.0."""
    return [float(f == 1.0) for f in pass_fractions(completions, tests)]


VERIFIERS = {"exec_tests": exec_tests, "exec_tests_strict": exec_tests_strict}  # --reward_fn names
