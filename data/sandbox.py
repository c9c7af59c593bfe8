"""
Run untrusted Python programs (model-written code) against test cases, never in the trainer's process.
Standard library only; Linux. This file is also the sandbox's harness: `python -I -S data/sandbox.py`.

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
              an empty /tmp and the working directory /work. Nothing else exists inside: not the
              trainer's files, out_dir, other runs, /root or /home; `..` and absolute paths lead
              nowhere else.
  uid         (root) setgroups([]) + setgid/setuid to an otherwise unused uid per pool slot, and
              PR_SET_NO_NEW_PRIVS: no capabilities, no setuid binaries, RLIMIT_NPROC applies (it
              does not to root), and the trainer (root) cannot be signalled.
  rlimits     always: CPU seconds, address space, file size (stdout/stderr and any file written),
              process count, open files, no core dumps; plus the wall-clock timeout per case and a
              SIGKILL of the case's whole tree (kill(-1) inside the sandbox's PID namespace / uid).
  always      a fresh temp working directory, stdin from a pipe, bounded output capture, killpg of
              the session and removal of the temp directory afterwards.
Without root (a normal user account) the harness can only try an unprivileged user + network
namespace (no network) and otherwise runs with rlimits, a temp cwd and a scrubbed environment: the
program then runs as your user and CAN read and write whatever you can. `isolation()` reports it and
the first run prints a warning.

What it does not protect against (it is not a container): kernel exploits (same kernel, no seccomp
filter), memory beyond RLIMIT_AS x RLIMIT_NPROC (no memory cgroup), CPU contention (no cpu cgroup),
side channels, and reward hacking from inside the program's own process: a case's test code runs in
the program's process (as in HumanEval and LiveCodeBench), so a program that sets out to can forge
its own pass of an assert-style test (stdin/stdout cases are compared outside, against outputs the
sandbox never sees). For a stronger boundary, set `WRAPPER` (or Limits.wrapper) to a command prefix
that runs the harness elsewhere and forwards stdin/stdout: ["bwrap", "--unshare-all", "--ro-bind",
"/usr", "/usr", ...], ["docker", "run", "-i", "--rm", "--network=none", IMAGE], ["nsjail", ...] or an
ssh / remote-sandbox client; the line protocol (see _harness_main) is all it needs.
"""
import base64
import ctypes
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

HARNESS = os.path.abspath(__file__)
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
    slot = _slots.get()
    try:
        return _run_in_slot(program, list(cases), limits, keep_going, slot)
    finally:
        _slots.put(slot)


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
    workdir = tempfile.mkdtemp(prefix="nanosdpo-sandbox-")
    proc = None
    results = []
    try:
        os.chmod(workdir, 0o755)
        if os.geteuid() == 0:
            os.chown(workdir, _sandbox_uid(slot), _sandbox_uid(slot))
        proc = subprocess.Popen(_harness_cmd(limits), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, cwd=workdir, env=_clean_env(), close_fds=True,
                                start_new_session=True)
        # JSON may write a byte as 6 ("\\u0000"): room for stdout and stderr escaped
        reader = _LineReader(proc.stdout.fileno(), cap=12 * limits.output_kb * 1024 + 65536)
        header = {"program": program, "uid": _sandbox_uid(slot), "workdir": workdir,
                  "limits": {k: getattr(limits, k) for k in ("timeout_s", "cpu_s", "memory_mb", "output_kb",
                                                             "disk_mb", "nproc", "nofile")}}
        if not _send(proc, header):
            return [Result("sandbox", detail="the sandbox harness did not start")]
        hello = reader.line(time.monotonic() + limits.startup_s)
        if not isinstance(hello, dict) or "isolation" not in hello:
            why = hello.get("error") if isinstance(hello, dict) else f"no answer from the harness ({hello})"
            return [Result("sandbox", detail=str(why)[:300])]
        _note_isolation(hello["isolation"])
        for i, case in enumerate(cases):
            if not _send(proc, {"stdin": case.stdin, "code": case.code, "main": case.main}):
                results.append(Result("killed", detail="the sandbox was killed"))
                break
            # the harness kills the case at timeout_s; the slack covers fork/exec and reading output
            msg = reader.line(time.monotonic() + limits.timeout_s + 5.0)
            r = _result(msg, limits)
            results.append(r)
            if not keep_going(i, r) or r.status == "sandbox":
                break
        return results
    finally:
        if proc is not None:
            _stop(proc)
        shutil.rmtree(workdir, ignore_errors=True)


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
    """EOF to the harness (it exits, and its PID namespace with it); then SIGKILL to the whole
    session, whatever survived, and reap."""
    try:
        proc.stdin.close()
    except OSError:
        pass
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
    if not _isolation:
        _isolation[:] = layers
        if "uid" not in layers and "chroot" not in layers and not _warned:
            _warned.append(1)
            print(f"warning: the code sandbox runs programs with only {', '.join(layers) or 'rlimits'} on this "
                  "machine (not root, no user namespaces): they can read and write what this user can; set "
                  "data.sandbox.WRAPPER to a stronger runner (see data/sandbox.py)", file=sys.stderr)


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


# ----------------------------------------------------------------------------- harness side
# Runs as `python -I -S -B data/sandbox.py` in the temp workdir. Protocol, one JSON object a line:
#   trainer -> harness  {"program", "uid", "workdir", "limits"}, then one {"stdin", "code", "main"}
#                       per case; EOF ends it
#   harness -> trainer  {"isolation": [...]}, then one result {"status", "stdout", "stderr",
#                       "detail", "result", "exit"} per case (or {"error"} if the harness failed)

_CLONE = {"ns": 0x00020000, "uts": 0x04000000, "ipc": 0x08000000, "user": 0x10000000, "pid": 0x20000000,
          "net": 0x40000000}
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
_PR_SET_NO_NEW_PRIVS = 38
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(ret, what):
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _mount(libc, src, target, fstype, flags, data=None):
    _check(libc.mount(src and src.encode(), target.encode(), fstype and fstype.encode(), ctypes.c_ulong(flags),
                      data and data.encode()), f"mount {target}")


def _build_root(libc, root, limits, uid):
    """A tmpfs at `root` with read-only binds of the system dirs and the interpreter, a few devices,
    /tmp and /work (owned by the sandbox uid)."""
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing we mount propagates to the host
    _mount(libc, "tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={limits['disk_mb']}m,nr_inodes=4096,mode=755")
    binds = [d for d in _SYSTEM_DIRS if os.path.lexists(d)]
    prefix = sys.base_prefix
    if not any(prefix == d or prefix.startswith(d + "/") for d in binds):
        binds.append(prefix)
    for d in binds:
        inside = root + d
        if os.path.islink(d):  # merged /usr: /bin -> usr/bin
            os.makedirs(os.path.dirname(inside), exist_ok=True)
            os.symlink(os.readlink(d), inside)
            continue
        os.makedirs(inside, exist_ok=True)
        for parent in _parents(root, d):
            os.chmod(parent, 0o755)
        _mount(libc, d, inside, None, _MS_BIND | _MS_REC)
        _mount(libc, None, inside, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    os.makedirs(root + "/dev")
    for dev in ("null", "zero", "random", "urandom"):
        open(root + "/dev/" + dev, "w").close()
        _mount(libc, "/dev/" + dev, root + "/dev/" + dev, None, _MS_BIND)
    for d, mode in (("/tmp", 0o1777), ("/work", 0o755)):
        os.makedirs(root + d)
        os.chmod(root + d, mode)
    os.chown(root + "/work", uid, uid)


def _parents(root, d):
    parts = d.strip("/").split("/")
    return [root + "/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _isolate(header):
    """Namespaces + chroot + uid when root; a user + network namespace when allowed; else nothing.
    Returns (layers, in_pid_namespace). Called in the harness before anything of the program runs."""
    libc, layers = _libc(), []
    uid, limits = header["uid"], header["limits"]
    if os.geteuid() == 0:
        flags = _CLONE["ns"] | _CLONE["net"] | _CLONE["pid"] | _CLONE["ipc"] | _CLONE["uts"]
        if libc.unshare(flags) == 0:
            layers.append("namespaces")
            try:
                _build_root(libc, os.getcwd(), limits, uid)
                layers.append("chroot")
            except OSError as e:
                layers.append(f"no-chroot({e.strerror})")
    else:
        uid_, gid_ = os.getuid(), os.getgid()
        if libc.unshare(_CLONE["user"] | _CLONE["net"]) == 0:  # unprivileged: no network, that is all
            try:
                for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid_} {uid_} 1"),
                                   ("/proc/self/gid_map", f"{gid_} {gid_} 1")):
                    with open(path, "w") as f:
                        f.write(text)
                layers.append("netns")
            except OSError:
                pass
    return layers, "namespaces" in layers


def _enter(header, layers):
    """In the PID namespace's init: chroot, rlimits, drop to the sandbox uid (order matters)."""
    import resource
    lim = header["limits"]
    if "chroot" in layers:
        root = os.getcwd()
        os.chroot(root)
        os.chdir("/work")
    mb = 1 << 20
    for res, value in ((resource.RLIMIT_AS, lim["memory_mb"] * mb), (resource.RLIMIT_NOFILE, lim["nofile"]), (resource.RLIMIT_CORE, 0),
                       (resource.RLIMIT_NPROC, lim["nproc"])):
        resource.setrlimit(res, (value, value))
    if os.geteuid() == 0:
        uid = header["uid"]
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        layers.append("uid")
    _libc().prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    layers.append("rlimits")


def _harness_main():
    import builtins, io, traceback  # noqa: F401  (loaded before the chroot; the cases use them)
    out = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    inp = sys.stdin.buffer

    def say(obj):
        data = (json.dumps(obj) + "\n").encode()
        while data:
            data = data[os.write(out, data):]

    try:
        header = json.loads(inp.readline())
        layers, pid_ns = _isolate(header)
    except Exception as e:  # a harness bug or a refused setup: report it, run nothing
        say({"error": f"sandbox setup failed: {type(e).__name__}: {e}"})
        return 1
    if pid_ns:
        # the first child is PID 1 of the new namespace: it runs the cases; this process only waits
        pid = os.fork()
        if pid:
            os.close(out)
            inp.close()
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status)
    try:
        _enter(header, layers)
    except Exception as e:
        say({"error": f"sandbox setup failed: {type(e).__name__}: {e}"})
        return 1
    say({"isolation": layers})
    own_tree = "uid" in layers or pid_ns  # kill(-1) reaches only the program's processes
    for line in inp:
        case = json.loads(line)
        say(_run_case(header, case, own_tree))
    return 0


_SIGNALS = {signal.SIGXFSZ: "output limit", signal.SIGXCPU: "CPU time limit", signal.SIGKILL: "killed",
            signal.SIGSEGV: "segmentation fault (memory or recursion)", signal.SIGABRT: "aborted"}


def _run_case(header, case, own_tree):
    """Fork, run program + case code in the child with the case's stdin; collect status and output."""
    lim = header["limits"]
    fds = {name: os.memfd_create(name) for name in ("stdin", "stdout", "stderr", "done")}
    data = case["stdin"].encode("utf-8", "replace")
    while data:
        data = data[os.write(fds["stdin"], data):]
    os.lseek(fds["stdin"], 0, 0)
    nonce = base64.b32encode(os.urandom(15)).decode()
    pid = os.fork()
    if pid == 0:
        _child(header, case, fds, nonce)  # never returns
    timed_out = not _wait(pid, lim["timeout_s"])
    if timed_out:
        _kill(pid)
    _, status = os.waitpid(pid, 0)
    _kill_tree(pid, own_tree)
    cap = lim["output_kb"] * 1024
    stdout, stderr, done = (_read(fds[k], cap) for k in ("stdout", "stderr", "done"))
    for fd in fds.values():
        os.close(fd)
    stderr = "\n".join(stderr.strip().splitlines()[-12:])[-2000:]
    code = os.waitstatus_to_exitcode(status)
    msg = {"stdout": stdout, "stderr": stderr, "exit": code, "result": None}
    finished = done.startswith(nonce + "\n")
    if timed_out:
        msg.update(status="timeout", detail=f"timed out after {lim['timeout_s']:g} s")
    elif code < 0:
        sig = -code
        what = _SIGNALS.get(sig, signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig))
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"signal {sig}"
        msg.update(status="killed", detail=f"killed by {name} ({what})")
    elif code != 0:
        last = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit status {code}"
        msg.update(status="error", detail=last[:300])
    elif case["code"] and not finished:
        msg.update(status="unfinished", detail="the program exited before its tests finished")
    else:
        msg.update(status="ok", detail="")
        if finished:
            msg["result"] = done[len(nonce) + 1:] or None
    return msg


def _child(header, case, fds, nonce):
    code = 1
    try:
        import resource
        os.setpgid(0, 0)
        cpu, fsize = header["limits"]["cpu_s"], header["limits"]["output_kb"] * 1024
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))  # here, not in the harness: it writes stdin
        for fd, target in ((fds["stdin"], 0), (fds["stdout"], 1), (fds["stderr"], 2), (fds["done"], 3)):
            os.dup2(fd, target)
        os.closerange(4, 1 << 16)
        sys.stdin = sys.__stdin__ = open(0, "r", encoding="utf-8", errors="replace", closefd=False)
        sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", errors="replace", closefd=False)
        sys.stderr = sys.__stderr__ = open(2, "w", encoding="utf-8", errors="replace", closefd=False)
        sys.argv = ["solution.py"]
        program, test = header["program"], case["code"]
        import linecache  # tracebacks show the program's lines
        for name, src in (("solution.py", program), ("test.py", test)):
            linecache.cache[name] = (len(src), None, src.splitlines(True), name)
        g = {"__name__": "__main__" if case["main"] else "solution", "__builtins__": __builtins__}
        try:
            exec(compile(program, "solution.py", "exec"), g)
            if test:
                exec(compile(test, "test.py", "exec"), g)
            result = g.get("__result__")
            os.write(3, (nonce + "\n" + ("" if result is None else str(result))).encode("utf-8", "replace"))
            code = 0
        except SystemExit as e:
            code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException as e:
            import traceback  # the program's frames (not this one), the last few: what a programmer reads
            traceback.print_exception(type(e), e, e.__traceback__.tb_next, limit=-4)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(code & 0xFF if isinstance(code, int) else 1)


def _wait(pid, timeout):
    """True when the child exited within timeout seconds."""
    fd = os.pidfd_open(pid)
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def _kill(pid):
    for target in (-pid, pid):
        try:
            os.kill(target, signal.SIGKILL)
        except OSError:
            pass


def _kill_tree(pid, own_tree):
    """Kill what the case left behind (forked children, daemons) and reap the zombies. kill(-1)
    reaches every process this uid / PID namespace may signal: only the program's own."""
    _kill(pid)
    if own_tree:
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG if not own_tree else 0)[0] == 0:
                break
        except ChildProcessError:
            break


def _read(fd, cap):
    os.lseek(fd, 0, 0)
    return os.read(fd, cap).decode("utf-8", "replace")


if __name__ == "__main__":
    sys.exit(_harness_main())
