"""
Run untrusted Python programs (model-written code) against test cases, never in the trainer's process.
Standard library only; Linux. The harness, the part that runs in the sandbox, is data/sandbox_harness.py.

    results = run(program, [Case(stdin="1 2\\n"), Case(stdin="3 4\\n")])           # one program
    all_results = run_many([Job(program, cases), ...])                          # a pool, across cores

One program = one harness process tree, started with subprocess (start_new_session, close_fds, a
scrubbed environment, the base interpreter with -I -S: no PYTHONPATH, no site-packages, no cwd on
sys.path). The trainer then feeds it one test case at a time over a pipe and reads one JSON result
line back, deciding after each whether to send the next (tests of a program stop at the first
failure; the harness never holds the cases it has not been sent, and never the expected outputs:
outputs are compared in the trainer). Each case runs in a fresh fork of the harness, so state does
not leak between cases and Python starts once per program, not once per test.

What the harness does before running anything, as far as the OS lets it (`isolation()` says which):
  namespaces  (root) unshare mount, network, PID, IPC and UTS namespaces: no network at all (an
              empty network namespace has only a downed loopback), and the harness is PID 1 of its
              PID namespace: its children cannot signal it, and every process of the program dies
              when it exits (daemons, setsid'd children, lingering threads included).
  chroot      (root) a new root on a size-capped tmpfs holding read-only, nosuid bind mounts of
              /usr (/bin, /lib ...) and the interpreter's prefix, /dev/{null,zero,random,urandom},
              an empty /tmp and the working directory /work: pivot_root onto the tmpfs, the old
              root detached, then a chroot one level inside it (a chrooted process may not create
              a user namespace, where it would regain capabilities). Nothing else exists inside:
              not the trainer's files, out_dir, other runs, /root or /home; `..` and absolute
              paths lead nowhere else.
  uid         (root) setgroups([]) + setgid/setuid to an otherwise unused uid per pool slot, and
              PR_SET_NO_NEW_PRIVS: no capabilities, no setuid binaries, RLIMIT_NPROC applies (it
              does not to root), and the trainer (root) cannot be signalled.
  rlimits     always: CPU seconds, address space, file size (stdout/stderr and any file written),
              process count, open files, no core dumps; plus the wall-clock timeout per case and a
              SIGKILL of the case's whole tree (kill(-1) inside the sandbox's PID namespace / uid).
  always      a fresh temp working directory, stdin from an anonymous file (memfd), bounded output
              capture, killpg of the session and removal of the temp directory afterwards.
Without root (a normal user account) the harness can only try an unprivileged user + network
namespace (no network) and otherwise runs with rlimits, a temp cwd and a scrubbed environment: the
program then runs as your user and CAN read and write whatever you can. `isolation()` reports it and
the first run prints a warning.
As root where namespaces are refused (a container without CAP_SYS_ADMIN) it keeps the uid and the
rlimits; world-readable files are then readable, and the interpreter's own files must be readable
by other users for the program's imports (a Python installed under /root is not).

What it does not protect against (it is not a container): kernel exploits (same kernel, no seccomp
filter), memory beyond RLIMIT_AS x RLIMIT_NPROC (no memory cgroup), CPU contention (no cpu cgroup),
disk use without the chroot (then RLIMIT_FSIZE bounds each file, not their number),
side channels, and reward hacking from inside the program's own process: a case's test code runs in
the program's process (as in HumanEval and LiveCodeBench), so a program that sets out to can forge
its own pass of an assert-style test (stdin/stdout cases are compared outside, against outputs the
sandbox never sees). For a stronger boundary, set `WRAPPER` (or Limits.wrapper) to a command prefix
that runs the harness elsewhere and forwards stdin/stdout: ["bwrap", "--unshare-all", "--ro-bind",
"/usr", "/usr", ...], ["docker", "run", "-i", "--rm", "--network=none", IMAGE], ["nsjail", ...] or an
ssh / remote-sandbox client; the line protocol (data/sandbox_harness.py) is all it needs.
"""
import atexit
import json
import os
import queue
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_harness.py")
WRAPPER = []  # command prefix for a stronger runner (bwrap, docker run -i, nsjail, ...): see the docstring
UID_BASE = 3_000_000_000  # sandbox uids: UID_BASE + 64 * (pid % 4096) + slot, unused by any account


@dataclass
class Limits:
    timeout_s: float = 6.0  # wall clock per case (the case's process tree is killed after it)
    cpu_s: int = 10  # RLIMIT_CPU per case
    memory_mb: int = 2048  # RLIMIT_AS per process
    output_kb: int = 4096  # RLIMIT_FSIZE: stdout, stderr and any file written; also what comes back
    disk_mb: int = 64  # size of the sandbox's tmpfs root (files the program writes)
    nproc: int = 64  # RLIMIT_NPROC: processes of the sandbox uid (root only; a fork bomb stops here)
    nofile: int = 64  # RLIMIT_NOFILE
    startup_s: float = 30.0  # how long the harness may take to start (generous: a loaded machine)
    wrapper: list = None  # command prefix (None: the module's WRAPPER)
    isolation: str = "auto"  # 'auto' (all the OS allows), 'uid' (as root: the uid and rlimits, no namespaces), 'user'
    #                          (the unprivileged namespaces only), 'none' (rlimits: for a wrapper that isolates
    #                          already; as root the program then runs as root)


@dataclass
class Case:
    stdin: str = ""  # the program's standard input
    code: str = ""  # test code run after the program, in its namespace; may set __result__ (a str)
    main: bool = True  # run the program as __main__ (stdin/stdout tests), else as module "solution"


@dataclass
class Result:
    status: str  # 'ok' | 'error' (exception, non-zero exit) | 'timeout' | 'killed' (a signal: memory,
    #              CPU, output limits) | 'unfinished' (exited before its test code ended) | 'sandbox'
    stdout: str = ""
    stderr: str = ""  # the last lines only
    detail: str = ""  # one line for people: "timed out after 6 s", "killed by SIGXFSZ (output limit)"
    result: str = None  # the case code's __result__, when it ran to its end
    exit: int = None


@dataclass
class Job:
    program: str
    cases: list
    limits: Limits = field(default_factory=Limits)
    keep_going: object = None  # keep_going(i, result) -> bool: run case i+1? (default: result ok)


# ----------------------------------------------------------------------------- trainer side

_slots = queue.Queue()
for _i in range(64):
    _slots.put(_i)
_warned = []


def run(program, cases, limits=None, keep_going=None):
    """Run `program` on each case in turn, in one sandbox; [Result] (one per case run: the cases
    after the first that keep_going rejects are not run). Never raises for anything the program does."""
    limits = limits or Limits()
    keep_going = keep_going or (lambda i, r: r.status == "ok")
    return _run_in_slot(program, list(cases), limits, keep_going, _slots.get())  # the reaper frees the slot


_pool = []


def run_many(jobs, workers=0):
    """[run(job...) for job in jobs], `workers` sandboxes at a time (0 = one per core)."""
    from concurrent.futures import ThreadPoolExecutor
    workers = min(workers or os.cpu_count() or 1, 64)
    if not _pool or _pool[0][0] != workers:
        _pool[:] = [(workers, ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox"))]
    return list(_pool[0][1].map(lambda j: run(j.program, j.cases, j.limits, j.keep_going), jobs))


def isolation():
    """The isolation layers the harness gets on this machine, e.g. ['namespaces', 'chroot', 'uid',
    'rlimits'], from one trivial run (cached)."""
    if not _isolation:
        run("pass", [Case()])
    return list(_isolation)


_isolation = []


def _sandbox_uid(slot):
    return UID_BASE + 64 * (os.getpid() % 4096) + slot


def _harness_cmd(limits):
    wrapper = WRAPPER if limits.wrapper is None else limits.wrapper
    python = getattr(sys, "_base_executable", None) or sys.executable
    return list(wrapper) + [python, "-I", "-S", "-B", HARNESS]


def _clean_env():
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": "/work",
            "TMPDIR": "/tmp"}


def _run_in_slot(program, cases, limits, keep_going, slot):
    proc, workdir, results = None, None, []
    try:
        workdir = tempfile.mkdtemp(prefix="nanosdpo-sandbox-")
        os.chmod(workdir, 0o755)
        if os.geteuid() == 0:
            os.chown(workdir, _sandbox_uid(slot), _sandbox_uid(slot))
        proc = subprocess.Popen(_harness_cmd(limits), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, cwd=workdir, env=_clean_env(), close_fds=True,
                                start_new_session=True)
        # JSON may write a byte as 6 ("\\u0000"): room for stdout and stderr escaped
        reader = _LineReader(proc.stdout.fileno(), cap=12 * limits.output_kb * 1024 + 65536)
        header = {"program": program, "uid": _sandbox_uid(slot), "workdir": workdir, "isolation": limits.isolation,
                  "limits": {k: getattr(limits, k) for k in ("timeout_s", "cpu_s", "memory_mb", "output_kb",
                                                             "disk_mb", "nproc", "nofile")}}
        if not _send(proc, header):
            return [Result("sandbox", detail="the sandbox harness did not start")]
        hello = reader.line(time.monotonic() + limits.startup_s)
        if not isinstance(hello, dict) or "isolation" not in hello:
            why = hello.get("error") if isinstance(hello, dict) else f"no answer from the harness ({hello})"
            return [Result("sandbox", detail=str(why)[:300])]
        if limits.isolation == "auto":
            _note_isolation(hello["isolation"])
        for i, case in enumerate(cases):
            if not _send(proc, {"stdin": case.stdin, "code": case.code, "main": case.main}):
                results.append(Result("killed", detail="the sandbox was killed"))
                break
            # the harness kills the case at timeout_s; the slack covers fork/exec and reading output
            msg = reader.line(time.monotonic() + limits.timeout_s + 5.0)
            r = _result(msg, limits)
            results.append(r)
            if not isinstance(msg, dict) or r.status == "sandbox" or not keep_going(i, r):
                break  # a harness that stopped answering gets no further case
        return results
    finally:
        _reap_later(proc, workdir, slot)


_reaper = []
_reaper_lock = threading.Lock()


def _reap_later(proc, workdir, slot):
    """Tear a finished sandbox down off the caller's path: EOF to the harness now (it exits, and its
    PID namespace with it), then, in a background thread, SIGKILL to its session, the reap, the temp
    dir's removal and the slot's release. The caller has its results ~30 ms sooner per program."""
    if proc is not None:
        try:
            proc.stdin.close()
        except OSError:
            pass
    with _reaper_lock:
        if not _reaper:
            _reaper.append(queue.Queue())
            threading.Thread(target=_reap_forever, args=(_reaper[0],), daemon=True, name="sandbox-reaper").start()
            atexit.register(lambda: _reaper[0].join())
    _reaper[0].put((proc, workdir, slot))


def settle():
    """Wait until every finished sandbox is torn down (its processes gone, its temp dir removed)."""
    if _reaper:
        _reaper[0].join()


def _reap_forever(todo):
    while True:
        proc, workdir, slot = todo.get()
        try:
            if proc is not None:
                _stop(proc)
            if workdir:
                shutil.rmtree(workdir, ignore_errors=True)
        finally:
            _slots.put(slot)
            todo.task_done()


def _result(msg, limits):
    if msg == _LineReader.TIMEOUT:
        return Result("timeout", detail=f"timed out after {limits.timeout_s:g} s")
    if msg == _LineReader.DIED:
        return Result("killed", detail="the sandbox process died")
    if "status" not in msg:
        return Result("sandbox", detail=str(msg.get("error", "the sandbox harness failed"))[:300])
    return Result(msg["status"], stdout=msg.get("stdout", ""), stderr=msg.get("stderr", ""),
                  detail=msg.get("detail", ""), result=msg.get("result"), exit=msg.get("exit"))


def _send(proc, obj):
    try:
        proc.stdin.write((json.dumps(obj) + "\n").encode())
        proc.stdin.flush()
        return True
    except (BrokenPipeError, OSError, ValueError):
        return False


def _stop(proc):
    """Wait for the harness to exit (its stdin is closed), SIGKILL whatever of its session survived,
    and reap."""
    try:
        proc.wait(timeout=2.0)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the session's process group (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        pass
    proc.stdout.close()


def _note_isolation(layers):
    """Record the layers the harness got; say once, on stderr, what is missing."""
    if _isolation:
        return
    _isolation[:] = layers
    missing = [what for what, present in (
        ("a uid of their own (they run as this user: they can read and write what it can, and signal it)",
         "uid" in layers),
        ("a chroot (world-readable files, e.g. the trainer's, are readable)", "chroot" in layers),
        ("a network namespace (they can reach the network)", "namespaces" in layers or "netns" in layers)) if not present]
    if missing and not _warned:
        _warned.append(1)
        print(f"warning: the code sandbox has no {'; no '.join(missing)} on this machine (it gets: "
              f"{', '.join(layers)}); run as root, or set data.sandbox.WRAPPER to a stronger runner "
              "(see data/sandbox.py)", file=sys.stderr)


class _LineReader:
    """JSON lines from a pipe with a deadline per line and a cap on a line's size. line() returns
    the object, TIMEOUT, or DIED (EOF, a cut or garbled line)."""
    TIMEOUT, DIED = "timeout", "died"

    def __init__(self, fd, cap):
        self.fd, self.cap, self.buf = fd, cap, bytearray()

    def line(self, deadline):
        start = 0
        while (end := self.buf.find(b"\n", start)) < 0:
            start = len(self.buf)
            left = deadline - time.monotonic()
            if left <= 0:
                return self.TIMEOUT
            if len(self.buf) > self.cap:
                return self.DIED
            if not select.select([self.fd], [], [], left)[0]:
                return self.TIMEOUT
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                return self.DIED
            self.buf += chunk
        raw = bytes(self.buf[:end])
        del self.buf[:end + 1]
        try:
            obj = json.loads(raw)
        except ValueError:
            return self.DIED
        return obj if isinstance(obj, dict) else self.DIED
