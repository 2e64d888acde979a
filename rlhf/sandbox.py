"""sandbox.py: run generated Python in a separate, limited process, and the execution verifiers
built on it (`--reward_fn exec_tests`, `exec_tests_strict`), which the code cannot fool.

Imports nothing from the project, so it can be read, tested and reused alone.

How one completion runs (`_spawn`):
- a fresh `python -I -S` process (isolated mode: no PYTHON* variables, the working directory not
  on sys.path; -S: no site-packages, so the code imports the standard library only, and the
  interpreter starts in ~15 ms instead of ~75 ms) in its own session and process group, with a
  minimal environment: PATH, HOME (the working directory), LANG and one-thread settings for
  numeric libraries; nothing of the trainer's environment (tokens, keys) is passed;
- the job arrives on stdin and is read before the code runs; the code's stdout and stderr go to a
  file of the parent's (capped by the file-size limit; the first OUTPUT_CHARS characters are kept
  for diagnosis), the report goes back through a separate descriptor to another such file;
- before the code runs, the harness in the child (HARNESS below) sets, for itself and the code:
  RLIMIT_CPU (CPU seconds; SIGXCPU then SIGKILL), RLIMIT_AS (address space: a large allocation
  raises MemoryError), RLIMIT_FSIZE (largest file it may write), RLIMIT_NOFILE (open files) and
  RLIMIT_NPROC = 1 (no new process or thread: fork, subprocess and threads fail), and a seccomp
  filter (SECCOMP, x86_64 and aarch64) that denies the kernel keyrings (a uid's keys outlive its
  processes, so a run could leave state for the next run on its uid), bpf, userfaultfd,
  perf_event_open, io_uring, unshare and setns (a new user namespace is the usual first step of a
  kernel exploit), memfd_create and pidfd_open; Python's limit on int <-> decimal text is lifted
  (a correct answer may be a 5,000-digit number);
- when the trainer runs as root (the usual container), the harness first enters new network, IPC
  and mount namespaces (unshare through libc): no interface but a down loopback, so no socket
  can reach anything; no System V object or message queue another run can see; every mount
  read-only, and fresh tmpfs mounts of SCRATCH_MB on /tmp (the working directory), /var/tmp and
  /dev/shm, private to this run and gone with its last process, so no file the code writes
  outlives the run and no run reads what another left. The interpreter's library folders that
  the unprivileged uid could not reach (a python under a mode-700 home, as pyenv or conda install
  it, or under /tmp) are bind-mounted again at their own path, read-only, over an empty tmpfs on
  that home, without their site-packages (an empty tmpfs covers it): the code imports the whole
  standard library and sees nothing else of the home (`check` names any common module it still
  cannot import). It then drops to an unprivileged uid of
  its own (`_uid`: one per pool slot and per trainer process, one per concurrent run):
  RLIMIT_NPROC is enforced for it (root ignores it), it cannot read the trainer's memory or
  root's files, and it can signal no process but itself;
- the parent waits at most `timeout` wall-clock seconds, then kills the whole process group
  (SIGKILL), always, also after a normal exit.

Two kinds of job:
- `run` (statements; tools.py's tool calls and the containment tests): each statement runs in
  the code's namespace after the code, and passes when it raises nothing. The code shares the
  process with the statements and the report, so this says what the code did, not whether it is
  right: never a reward.
- `verify` (the verifiers): a test is one or more `assert f(<literals>) == <literal>` (TEST_FORM).
  The parent parses it (ast) into the call f(...) and the expected value; the child receives the
  code and the calls only, never an expected value, runs the code as a module named `solution`
  (not `__main__`: a demo under `if __name__ == "__main__":` that reads input() does not run),
  and returns what each call returned as plain data (None, bool, int, float, str, and lists,
  tuples and dicts of them; a value of any other type, a subclass included, fails its test). The
  report is one length-prefixed Python literal, which the parent parses with ast.literal_eval and
  checks type by type (anything else, a torn or a second frame included: every test fails), and
  the parent compares each value with the expected one it alone holds. So nothing the code does in its process (an always-true __eq__,
  rebinding builtins, patching the harness, forging the report, walking the frames) makes a wrong
  value pass: to pass, the code must return the right values.
An error in the code (syntax, exception, exit, crash, timeout, limit) fails the tests it did not
get to pass: a reward of 0, never an exception in the trainer. In `verify`, an exception or exit
at module level (a usage line after the solution that reads input()) does not: the calls still run
on what the code defined, and only their values count.

Without root the code runs as the trainer's own user, with none of the namespaces: it can read
and change this user's files (the tests on disk included), leave files in /tmp that a later run
reads, read the trainer's memory, signal it and reach the network. `check` says so on stderr when the first batch runs. As root it still can
read world-readable files (e.g. /etc, the project's source, and a dataset file with its tests if
others may read it: keep such files mode 600), and there is no cgroup and no seccomp filter
beyond SECCOMP's few calls (kernel exploits and contention with the trainer are not prevented):
use a container or a VM for code you would not run on your own machine.

Parallel runs (`run_batch`, `verify_batch`): a thread pool of `workers` (default: the cores this
process may use) starts the processes; identical jobs of a batch run once. Each run is
independent, so results do not depend on the pool size or on timing, except that a run that
exceeds its time limit (more likely on a loaded machine) fails.

The verifiers (`exec_tests`, `exec_tests_strict`) follow TRL's reward-function contract,
fn(prompts=, completions=, **columns): completions are strings or conversations (the content of
the last *assistant* message, a string or a list of text parts: a tool's reply is never code),
the tests come from the dataset column `tests` (a list of tests such as ["assert f(2) == 7",
"assert f(-1) == -2"], or one string, which counts as one test), and the code is extracted from
the completion by `extract_code`. A row whose tests are empty, blank or not of TEST_FORM is
refused with an error naming it, not scored.
"""

import ast
import contextlib
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
SCRATCH_MB = 16  # as root: the size of each private tmpfs (/tmp, /var/tmp, /dev/shm)
OPEN_FILES = 32  # RLIMIT_NOFILE
OUTPUT_CHARS = 2000  # characters of the code's output kept in Result.output
REPORT_BYTES = 1 << 16  # a larger report is no report; verify adds room for the expected values (parsing costs the trainer)
UID_BASE, UID_RANGE = 61000, 4096  # as root, runs take uids in UID_BASE..UID_BASE+UID_RANGE-1 (no user may hold one)
MAX_WORKERS = 64  # pool slots per process
PROBE_MODULES = ("collections", "functools", "itertools", "math", "re", "string", "typing", "heapq", "bisect",
                 "random", "dataclasses", "json", "fractions", "statistics")  # check() says which of these fail
MAX_DEPTH = 190  # an answer nested deeper fails; the parent's parser reads ~200 levels, the report wraps it in 3
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
       "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # + HOME = the working directory
TEST_FORM = "assert f(<literals>) == <literal>"
PLAIN = (type(None), bool, int, float, str)  # and list, tuple, dict of plain values
# seccomp: (the audit arch, the denied syscalls: add_key, request_key, keyctl, bpf, userfaultfd, perf_event_open,
# io_uring_*, unshare, setns, memfd_create, pidfd_open)
SECCOMP = {"x86_64": (0xC000003E, (248, 249, 250, 321, 323, 298, 425, 426, 427, 272, 308, 319, 434)),
           "aarch64": (0xC00000B7, (217, 218, 219, 280, 282, 241, 425, 426, 427, 97, 268, 279, 434))}


class SandboxError(RuntimeError):
    """The sandbox itself cannot run (not the code it runs): the message says what to fix."""


@dataclass(frozen=True)
class Result:
    passed: tuple  # one bool per test
    status: str  # ok | error (the code raised or did not compile) | timeout | crashed (no valid report: killed, exit, limit, forged)
    output: str = ""  # the start of what the code printed, and the error


# ---------------------------------------------------------------- the child
# Runs in the fresh interpreter. Everything before `exec` is trusted set-up; after it, the code,
# which can change anything in this process: the parent trusts nothing it reports but plain data.
HARNESS = r"""
import marshal, os, resource, sys


def main():
    job = marshal.loads(sys.stdin.buffer.read())
    fd = os.dup(1)  # the report's descriptor; the code's prints go to the output file
    os.dup2(2, 1)
    type_, repr_, str_, hex_, write, exit_ = type, repr, str, hex, os.write, os._exit  # the code may rebind builtins
    if hasattr(sys, "set_int_max_str_digits"):  # a correct answer may print or parse an int of any size
        sys.set_int_max_str_digits(0)

    def send(text):  # one frame: b"<length>\n<a Python literal>", then exit
        try:
            sys.stdout.flush()  # what the code printed, for Result.output
        except BaseException:  # the code closed or replaced sys.stdout: its output is not ours to report
            pass
        data = text.encode()
        data = b"%d\n" % len(data) + data
        while data:
            data = data[write(fd, data):]
        exit_(0)

    def describe(e):
        try:
            return type_(e).__name__ + ": " + str_(e)[:300]
        except BaseException:
            return "an exception that cannot be printed"

    def encode(v, depth):  # plain data as a Python literal, exact types only
        t = type_(v)
        if depth > job["max_depth"]:
            raise ValueError("nested deeper than %d" % job["max_depth"])
        if t is int and not -(1 << 10000) < v < 1 << 10000:  # hex: no digit limit in the parent's parser, and linear
            return hex_(v)
        if v is None or t is bool or t is int or t is str:
            return repr_(v)
        if t is float:
            if v != v:
                raise ValueError("nan equals nothing")
            return repr_(v) if v - v == 0 else "1e999" if v > 0 else "-1e999"
        if t is list or t is tuple:
            items = ",".join([encode(x, depth + 1) for x in v])
            return "[" + items + "]" if t is list else "(" + items + ",)" if items else "()"
        if t is dict:
            return "{" + ",".join([encode(k, depth + 1) + ":" + encode(x, depth + 1) for k, x in v.items()]) + "}"
        raise TypeError(t.__name__ + " is not plain data (None, bool, int, float, str, list, tuple, dict)")

    if job["uid"] is not None:  # root: private namespaces, then an unprivileged uid of our own
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)

        def need(ok, what):
            if not ok:
                send(repr_({"setup_error": what + ": " + os.strerror(ctypes.get_errno())}))

        def private_top(path):  # the outermost folder above `path` that others may not enter (a mode-700 home)
            top = None
            while os.path.dirname(path) != path:
                path = os.path.dirname(path)
                if not os.stat(path).st_mode & 0o001 and path != "/":  # no tmpfs over /: then check() tells
                    top = path
            return top

        def under(path, folder):
            return path == folder or path.startswith(folder.rstrip("/") + "/")

        need(libc.unshare(0x40000000 | 0x08000000 | 0x00020000) == 0, "unshare(CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWNS)")
        need(libc.mount(None, b"/", None, 0x4000 | 0x40000, None) == 0, "mount(/, MS_REC | MS_PRIVATE)")  # nothing propagates out
        attr = (ctypes.c_uint64 * 4)(1, 0, 0, 0)  # MOUNT_ATTR_RDONLY
        if libc.syscall(442, -100, b"/", 0x8000, attr, 32) != 0:  # mount_setattr(AT_RECURSIVE): Linux 5.12+
            flags = {"nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21}
            with open("/proc/self/mountinfo") as f:  # older kernels: remount every mount read-only
                mounts = [line.split() for line in f]
            for m in mounts:
                keep = sum(flags.get(o, 0) for o in m[5].split(","))
                point = m[4].replace("\\040", " ").encode()
                need(libc.mount(None, point, None, 32 | 4096 | 1 | keep, None) == 0, "remount read-only " + m[4])
        # the interpreter's library folders that the unprivileged uid could not reach: below a private
        # home (pyenv, conda) or below a scratch place that a tmpfs will hide. Held open (in this mount
        # namespace, where a bind mount may start), then shown again at their path after the mounts,
        # read-only, and nothing else of that home
        folders = [p for p in sys.path if p and os.path.isdir(p)]
        folders = [p for p in folders if not any(q != p and under(p, q) for q in folders)]
        reveal = [(p, private_top(p), os.open(p, os.O_PATH | os.O_DIRECTORY)) for p in folders
                  if private_top(p) or any(under(p, s) for s in job["scratch"])]
        for path in job["scratch"]:  # MS_NOSUID | MS_NODEV
            options = "size=%dm,nr_inodes=4096,mode=0700,uid=%d,gid=%d" % (job["scratch_mb"], job["uid"], job["uid"])
            need(libc.mount(b"tmpfs", path.encode(), b"tmpfs", 2 | 4, options.encode()) == 0, "mount tmpfs on " + path)
        tops = []  # private homes covered by an empty read-only tmpfs that others may enter
        for path, top, held in reveal:
            if top not in (None, *tops) and not any(under(top, s) for s in job["scratch"]):
                need(libc.mount(b"tmpfs", top.encode(), b"tmpfs", 2 | 4, b"size=1m,nr_inodes=4096,mode=0755") == 0,
                     "mount tmpfs on " + top)
                tops.append(top)
            made = "/"
            for part in path.strip("/").split("/"):  # the path again, each folder enterable by others
                made = os.path.join(made, part)
                if not os.path.isdir(made):
                    os.mkdir(made)
                    os.chmod(made, 0o755)
            need(libc.mount(("/proc/self/fd/%d" % held).encode(), path.encode(), None, 4096 | 16384, None) == 0,
                 "bind-mount " + path)  # MS_BIND | MS_REC
            need(libc.mount(None, path.encode(), None, 32 | 4096 | 1 | 2 | 4, None) == 0, "remount read-only " + path)
            os.close(held)
            for sub in ("site-packages", "dist-packages"):  # the trainer's installed packages stay hidden (-S)
                hide = os.path.join(path, sub)
                if os.path.isdir(hide):
                    need(libc.mount(b"tmpfs", hide.encode(), b"tmpfs", 1 | 2 | 4, b"size=64k,nr_inodes=16,mode=0755") == 0,
                         "mount tmpfs on " + hide)
        for top in tops:  # MS_REMOUNT | MS_RDONLY
            need(libc.mount(None, top.encode(), None, 32 | 1, None) == 0, "remount read-only " + top)
        os.chdir("/tmp")
        os.setgroups([]); os.setgid(job["uid"]); os.setuid(job["uid"])
    for name, value in job["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value + (name == "RLIMIT_CPU")))  # CPU: SIGXCPU, 1 s later SIGKILL
    if job["seccomp"]:  # deny the kernel keyrings (a uid's keys outlive its runs) and a few exploit surfaces: EPERM
        import ctypes
        arch, denied = job["seccomp"]
        program = [(0x20, 0, 0, 4), (0x15, 1, 0, arch), (0x06, 0, 0, 0x50001),  # another ABI (int 0x80): denied
                   (0x20, 0, 0, 0), (0x35, len(denied) + 1, 0, 0x40000000)]  # the syscall number; x32: denied
        program += [(0x15, len(denied) - i, 0, nr) for i, nr in enumerate(denied)] + [(0x06, 0, 0, 0x7FFF0000), (0x06, 0, 0, 0x50001)]
        filters = (ctypes.c_uint64 * len(program))(*[c | jt << 16 | jf << 24 | k << 32 for c, jt, jf, k in program])
        fprog = (ctypes.c_uint64 * 2)(len(program), ctypes.addressof(filters))  # struct sock_fprog
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, fprog, 0, 0) != 0:  # NO_NEW_PRIVS; SECCOMP_MODE_FILTER
            send(repr_({"setup_error": "seccomp: " + os.strerror(ctypes.get_errno())}))
    # not __main__: a `if __name__ == "__main__":` block (a demo that reads input()) is not run
    module = type_(sys)("solution")
    sys.modules["solution"] = module  # what dataclasses, pickle and typing look up by a class's __module__
    namespace = module.__dict__
    namespace["__builtins__"] = __builtins__
    error = None
    try:
        exec(compile(job["code"], "<completion>", "exec"), namespace)
    except BaseException as e:  # SystemExit and KeyboardInterrupt included: nothing the code does stops the report
        error = "code: " + describe(e)
    if job["calls"] is None:  # run: statements, each passes when it raises nothing
        passed = []
        for test in job["tests"] if error is None else ():
            try:
                exec(compile(test, "<test>", "exec"), namespace)
                passed.append("True")
            except BaseException as e:
                passed.append("False")
                error = error or "test: " + describe(e)
        send("{'error': " + repr_(error) + ", 'passed': [" + ",".join(passed) + "]}")
    # verify: what each call returned, as plain data. Also when the code raised after defining the
    # function (a usage line that reads input() or exits): only the returned values count
    results = []
    for name, args, kwargs in job["calls"]:
        try:
            value = namespace[name](*args, **kwargs)
        except BaseException as e:
            results.append("('raised', " + repr_(describe(e)) + ")")
            continue
        try:
            results.append("('value', " + encode(value, 0) + ")")
        except BaseException as e:
            results.append("('invalid', " + repr_(describe(e)) + ")")
    send("{'error': " + repr_(error) + ", 'results': [" + ",".join(results) + "]}")


main()
"""


@contextlib.contextmanager
def _any_digits():
    """Python's limit on int <-> decimal text (4300 digits) lifted: a test may expect a big number.
    The limit is process-wide and verify runs in a pool of threads: it is lifted while any thread
    is inside and restored when the last one leaves (a thread saving and restoring its own copy
    would leave it lifted, or restore it under another thread's repr)."""
    if not hasattr(sys, "set_int_max_str_digits"):
        yield
        return
    with _DIGITS["lock"]:
        if _DIGITS["inside"] == 0:
            _DIGITS["limit"] = sys.get_int_max_str_digits()
            sys.set_int_max_str_digits(0)
        _DIGITS["inside"] += 1
    try:
        yield
    finally:
        with _DIGITS["lock"]:
            _DIGITS["inside"] -= 1
            if _DIGITS["inside"] == 0:
                sys.set_int_max_str_digits(_DIGITS["limit"])


_DIGITS = {"lock": threading.Lock(), "inside": 0, "limit": None}  # _any_digits' shared state


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


def _frame(raw):
    """The report in the child's frame, b"<length>\\n<Python literal>", or None: a torn,
    oversized or extended frame (the code wrote to the descriptor) or anything but literals."""
    head, newline, body = raw.partition(b"\n")
    if not newline or not head.isdigit() or len(head) > 8 or int(head) != len(body):
        return None
    try:
        return ast.literal_eval(body.decode("utf-8"))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError, UnicodeDecodeError):
        return None


def _spawn(code, timeout, slot, tests=(), calls=None, report_bytes=REPORT_BYTES):
    """One run: (status, report or None, output). `calls` None: run `tests` as statements.
    Nothing the child writes outlives it (as root its only writable places are its tmpfs)."""
    private = tempfile.mkdtemp(prefix="sandbox-io-")  # ours (mode 700): its output and report files
    uid = _uid(slot)
    workdir = private if uid is not None else tempfile.mkdtemp(prefix="sandbox-")  # as root: cwd until /tmp
    try:
        job = marshal.dumps({"code": code, "tests": list(tests), "calls": calls, "uid": uid, "limits": _limits(timeout),
                             "scratch": [p for p in ("/tmp", "/var/tmp", "/dev/shm") if os.path.isdir(p)],
                             "scratch_mb": SCRATCH_MB, "seccomp": SECCOMP.get(os.uname().machine),
                             "max_depth": MAX_DEPTH})
        out_path, res_path = os.path.join(private, "output"), os.path.join(private, "report")
        with open(out_path, "wb") as out, open(res_path, "wb") as res:
            try:
                proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", HARNESS], stdin=subprocess.PIPE, stdout=res,
                                        stderr=out, cwd=workdir, env={**ENV, "HOME": "/tmp" if uid is not None else workdir},
                                        start_new_session=True, close_fds=True)
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
            raw = f.read(report_bytes + 1)
    finally:
        shutil.rmtree(private, ignore_errors=True)
        if workdir != private:
            shutil.rmtree(workdir, ignore_errors=True)
    report = _frame(raw) if len(raw) <= report_bytes else None
    # RLIMIT_CPU is the wall limit's ceiling: a busy loop can reach it (SIGXCPU) just before the deadline
    if timed_out or proc.returncode == -signal.SIGXCPU:
        return "timeout", None, output
    if not (type(report) is dict and type(report.get("error")) in (str, type(None))):
        return "crashed", report, output + f"\n[exit code {proc.returncode}]"
    error = report["error"] or ""
    output += "\n" + error if error else ""
    return ("error" if error.startswith("code:") else "ok"), report, output


def run(code, tests, timeout=TIMEOUT, slot=0):
    """Run `code`, then each of `tests` (Python statements), in a fresh limited process -> Result.
    A statement passes when it raises nothing, in the code's process: not a verifier (see `verify`)."""
    status, report, output = _spawn(code, timeout, slot, tests=tests)
    passed = report.get("passed") if status != "crashed" and report else None
    if not (type(passed) is list and len(passed) <= len(tests) and all(type(p) is bool for p in passed)):
        status, passed = ("crashed" if status != "timeout" else status), []
    passed = tuple(passed) + (False,) * (len(tests) - len(passed))  # unreached tests fail
    return Result(passed, status, output)


# ---------------------------------------------------------------- tests held outside the code
def _plain(value):
    """Whether `value` is plain data of exactly the PLAIN types, lists, tuples and dicts."""
    if type(value) in PLAIN:
        return True
    if type(value) in (list, tuple):
        return all(_plain(v) for v in value)
    return type(value) is dict and all(_plain(k) and _plain(v) for k, v in value.items())


def parse_test(test):
    """A test (one or more `assert f(<literals>) == <literal>` statements) -> the asserts'
    ((name, args, kwargs), expected) pairs; ValueError with the reason when it is not that form."""
    with _any_digits():
        return _parse_test(test)


def _depth(value):
    """How deeply `value` (plain data) nests lists, tuples and dicts: 0 for a scalar."""
    if type(value) in (list, tuple):
        return 1 + max(map(_depth, value), default=0)
    if type(value) is dict:
        return 1 + max((max(_depth(k), _depth(v)) for k, v in value.items()), default=0)
    return 0


def _parse_test(test):
    try:
        body = ast.parse(test).body
    except SyntaxError as e:
        raise ValueError(f"it is not Python ({e.msg})") from None
    if not body:
        raise ValueError("it holds no assert")
    pairs = []
    for node in body:
        compare = node.test if isinstance(node, ast.Assert) and node.msg is None else None
        if not (isinstance(compare, ast.Compare) and len(compare.ops) == 1 and isinstance(compare.ops[0], ast.Eq)
                and isinstance(compare.left, ast.Call) and isinstance(compare.left.func, ast.Name)):
            raise ValueError(f"{ast.unparse(node)[:80]!r} is not of that form")
        call = compare.left
        try:
            args = [ast.literal_eval(a) for a in call.args]  # a Starred argument is no literal
            kwargs = {k.arg: ast.literal_eval(k.value) if k.arg else ast.literal_eval(k) for k in call.keywords}  # **x: none
            expected = ast.literal_eval(compare.comparators[0])
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise ValueError(f"{ast.unparse(node)[:80]!r} has an argument or expected value that is no literal") from None
        if not _plain(expected):
            raise ValueError(f"{ast.unparse(node)[:80]!r} expects a value that is not None, bool, int, float, str, "
                             "or a list, tuple or dict of them")
        if _depth(expected) > MAX_DEPTH:
            raise ValueError(f"{ast.unparse(node)[:80]!r} expects a value nested deeper than {MAX_DEPTH} levels, more than "
                             "the verifier's report can hold")
        pairs.append(((call.func.id, args, kwargs), expected))
    return pairs


def verify(code, tests, timeout=TIMEOUT, slot=0):
    """Run `code` and the calls of `tests` (parse_test's lists of pairs) in a fresh limited
    process; a test passes when every call of it returned exactly its expected value -> Result."""
    calls = [call for pairs in tests for call, _ in pairs]
    # a report longer than the right values' (plus room for errors) cannot pass: not parsed
    with _any_digits():
        room = REPORT_BYTES + 400 * len(calls) + 2 * sum(len(repr(expected)) for pairs in tests for _, expected in pairs)
    status, report, output = _spawn(code, timeout, slot, calls=calls, report_bytes=room)
    # "error": the code raised at module level; the calls still ran, and their values count
    results = report.get("results") if status in ("ok", "error") and report else None
    if status in ("ok", "error") and not (type(results) is list and len(results) == len(calls)):
        status, output = "crashed", output + "\n[the report does not hold one result per call]"
    if status not in ("ok", "error"):
        return Result((False,) * len(tests), status, output)
    returned = iter(results)
    passed = []
    for pairs in tests:
        ok = True
        for _, expected in pairs:
            result = next(returned)  # ('value', plain data) when the call returned; anything else fails
            ok = ok and type(result) is tuple and len(result) == 2 and result[0] == "value" and _plain(result[1]) \
                and result[1] == expected  # plain data on both sides: == is the data's equality, no code of the child's
        passed.append(ok)
    return Result(tuple(passed), status, output)


# ---------------------------------------------------------------- a batch, in parallel
_checked = set()  # (euid, executable) pairs whose set-up worked
_check_lock = threading.Lock()
UNPROTECTED = ("sandbox: not running as root, so generated code runs as this user, without the namespaces: it can read "
               "and change this user's files (the tests on disk included), leave files in /tmp for a later run to "
               "read, read the trainer's memory, signal it and reach the network (sandbox.py); run as root, e.g. in a "
               "container, for a verifier the code cannot fool.")


def check():
    """Run one trivial job and raise SandboxError if it does not pass: a problem of the sandbox
    (no python, unshare or mount refused, setuid refused) is told once, up front, and never
    mistaken for a wrong completion; without root, say on stderr what is not isolated. Done once
    per process."""
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
        else:
            print(UNPROTECTED, file=sys.stderr)
        status, report, output = _spawn("def f(x):\n    return x + 1", 30.0, 0, calls=[("f", [1], {})])
        if status != "ok" or report.get("results") != [("value", 2)]:
            why = report.get("setup_error") if isinstance(report, dict) and report.get("setup_error") else f"status {status}: {output.strip()[:300]}"
            raise SandboxError(f"sandbox: a trivial job failed ({why}); the sandbox cannot run here (as root it needs "
                               "unshare and mount of new network, IPC and mount namespaces, and setuid: run the container "
                               "with CAP_SYS_ADMIN, or as a normal user).")
        # a module the code cannot import scores a correct answer 0: say so once, naming them
        result = run("", [f"import {name}" for name in PROBE_MODULES], timeout=30.0)
        missing = [name for name, ok in zip(PROBE_MODULES, result.passed) if not ok]
        if missing:
            print(f"sandbox: generated code cannot import {', '.join(missing)} ({sys.executable}: the unprivileged uid "
                  "cannot read these modules' files); correct code that imports them scores 0.", file=sys.stderr)
        _checked.add(key)


def default_workers():
    """The cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _pool(fn, jobs, workers, timeout):
    """fn(code, tests, timeout, slot) on each job, `workers` at a time; duplicates run once."""
    check()
    workers = min(MAX_WORKERS, max(1, workers or default_workers()))
    keys = [(code, marshal.dumps(list(tests))) for code, tests in jobs]
    unique = dict(zip(keys, jobs))
    slots = list(range(workers))  # a run takes a slot (its uid) and gives it back: never two runs on one uid
    lock = threading.Lock()

    def one(job):
        with lock:
            slot = slots.pop()
        try:
            return fn(job[0], job[1], timeout, slot)
        finally:
            with lock:
                slots.append(slot)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = dict(zip(unique, pool.map(one, unique.values())))
    return [results[key] for key in keys]


def run_batch(jobs, workers=None, timeout=TIMEOUT):
    """`run` on [(code, statements), ...] -> Results, in order."""
    return _pool(run, jobs, workers, timeout)


def verify_batch(jobs, workers=None, timeout=TIMEOUT):
    """`verify` on [(code, parsed tests), ...] -> Results, in order."""
    return _pool(verify, jobs, workers, timeout)


# ---------------------------------------------------------------- the verifiers
_OPEN = re.compile(r"([ \t]*)```+[ \t]*([A-Za-z0-9_+-]*)[^`]*")  # a fence line: its indent and its language
_CLOSE = re.compile(r"[ \t]*```+[ \t]*")
_CODE_START = re.compile(r"(def |async def |class |import |from [\w.]+ import |@|if __name__|[A-Za-z_]\w*(, *\w+)* *=[^=])")
PYTHON_TAGS = ("python", "py", "python3", "py3")
MAX_COMPILES = 200  # per completion: the tries of extract_code to find where code starts and ends


def _compiles(code):
    try:
        compile(code, "<completion>", "exec", dont_inherit=True)
        return True
    except (SyntaxError, ValueError, MemoryError, RecursionError, OverflowError):
        return False


def _fenced_blocks(lines, budget):
    """[(language, code)] of the fenced blocks, or None when a fence is never closed. A block ends
    at the first closing fence after which its code compiles (a docstring may hold a fence), else at
    the first closing fence; an indented fence (in a list item) has its indent removed."""
    blocks, i = [], 0
    while i < len(lines):
        opening = _OPEN.fullmatch(lines[i])
        if not opening:
            i += 1
            continue
        indent, language = opening.group(1), opening.group(2).lower()
        closes = [j for j in range(i + 1, len(lines)) if _CLOSE.fullmatch(lines[j])]
        if not closes:
            return None

        def body(j):
            return "\n".join(line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:j])

        end = closes[0]
        if language in PYTHON_TAGS or not language:
            for j in closes[:20]:
                budget[0] -= 1
                if budget[0] > 0 and _compiles(body(j)):
                    end = j
                    break
        blocks.append((language, body(end)))
        i = end + 1
    return blocks


def _unfenced_code(lines, budget):
    """The code in a text without fences: the spans that compile, from a line that starts a
    statement (def, class, import, an assignment, ...) to the last line before prose, joined."""
    spans, i = [], 0
    while i < len(lines) and budget[0] > 0:
        if not _CODE_START.match(lines[i]):
            i += 1
            continue
        # a span may end before any later line that starts at column 0: prose or more code
        ends = [j for j in range(len(lines), i, -1) if j == len(lines) or (lines[j][:1].strip() and j > i)]
        end = None
        for j in ends:
            budget[0] -= 1
            if budget[0] <= 0:
                break
            if _compiles("\n".join(lines[i:j])):
                end = j
                break
        if end is None:
            i += 1
            continue
        spans.append("\n".join(lines[i:end]))
        i = end
    return "\n".join(spans)


def extract_code(text):
    """The code in a completion (CRLF or LF line ends):
    - fenced blocks: those marked python (```python, ``` python, ```py, ```python3), else those with
      no language; of these, every block that compiles, in order (a helper, then the solution, then a
      usage example), else the last one. A fence never closed is not a block: the whole text, fence
      included, is the code (it does not compile: reward 0; a completion cut at the length limit);
    - no fence: the whole text when it compiles, else the spans of it that compile (code after or
      between prose), else the whole text."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = text.split("\n")
    budget = [MAX_COMPILES]
    with _any_digits():
        blocks = _fenced_blocks(lines, budget)
        if blocks is None:
            return text
        if blocks:
            chosen = [code for lang, code in blocks if lang in PYTHON_TAGS] or [code for lang, code in blocks if not lang]
            if not chosen:
                return blocks[-1][1]
            good = [code for code in chosen if _compiles(code)]
            return "\n".join(good) if good else chosen[-1]
        if _compiles(text):
            return text
        return _unfenced_code(lines, budget) or text


def _text_of(content):
    """A message's content as text: a string, or a list of parts (strings or {"type": "text", "text": ...})."""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        return "".join(p if isinstance(p, str) else p.get("text") or "" if isinstance(p, dict) else "" for p in content)
    return ""


def _completion_text(completion):
    """TRL: text, or messages, of which the last assistant message is the answer (a tool's reply,
    after it, is never the model's code; no assistant message: no code)."""
    if isinstance(completion, str):
        return completion
    answers = [m.get("content") for m in completion if m.get("role") == "assistant"]
    return _text_of(answers[-1]) if answers else ""


def _tests_of(row, tests):
    if isinstance(tests, str):
        tests = [tests]
    if not isinstance(tests, (list, tuple)) or not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError(f"exec_tests: row {row} of the `tests` column holds {str(tests)[:100]!r}; expected a non-empty "
                         f"list of tests of the form {TEST_FORM} (or one string of them).")
    parsed = []
    for test in tests:
        try:
            parsed.append(parse_test(test))
        except ValueError as e:
            raise ValueError(f"exec_tests: row {row} of the `tests` column holds the test {test[:100]!r}: {e}; the verifier "
                             f"compares values outside the code's process, so every test must be `{TEST_FORM}` (one or "
                             "more such lines; sandbox.py).") from None
    return parsed


def pass_fractions(completions, tests):
    """The fraction of its row's tests each completion passes."""
    if tests is None:
        raise ValueError("exec_tests: the dataset has no `tests` column; add one (a list of tests such as "
                         "[\"assert f(2) == 7\"] per row) or use another --reward_fn.")
    jobs = [(extract_code(_completion_text(c)), _tests_of(i, t)) for i, (c, t) in enumerate(zip(completions, tests))]
    return [sum(r.passed) / len(r.passed) for r in verify_batch(jobs)]


def exec_tests(prompts=None, completions=None, tests=None, **columns):
    """Fraction of the row's `tests` that the completion's code passes (0.0 on any error)."""
    return pass_fractions(completions, tests)


def exec_tests_strict(prompts=None, completions=None, tests=None, **columns):
    """1.0 when the completion's code passes every test of its row, else 0.0."""
    return [float(f == 1.0) for f in pass_fractions(completions, tests)]


VERIFIERS = {"exec_tests": exec_tests, "exec_tests_strict": exec_tests_strict}  # --reward_fn names
