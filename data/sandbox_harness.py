"""
The sandbox's harness: `python -I -S -B data/sandbox_harness.py`, started by data/sandbox.py (which
documents what it isolates and what it does not) in a fresh temp directory, as root or as the user.
It isolates itself (namespaces, a chroot, an unused uid, rlimits: whatever the OS allows), then runs
the cases it is sent, each in a fresh fork, and answers each with its status and output. It never
sees expected outputs. Imports are kept to the few it needs: it starts once per program.
"""
import ctypes
import json
import os
import select
import sys

# Protocol, one JSON object a line:
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


JAIL = "/jail"  # the program's root, one level inside the tmpfs (see _pivot_root)


def _build_root(libc, mount_point, limits, uid):
    """A tmpfs at `mount_point` holding JAIL: read-only binds of the system dirs and the
    interpreter, a few devices, /tmp and /work (owned by the sandbox uid)."""
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing we mount propagates to the host
    _mount(libc, "tmpfs", mount_point, "tmpfs", _MS_NOSUID | _MS_NODEV,
           f"size={limits['disk_mb']}m,nr_inodes=4096,mode=755")
    root = mount_point + JAIL
    os.mkdir(root, 0o755)
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
    """Namespaces + chroot + uid when root; a user + network namespace when allowed; else nothing
    (header["isolation"]: 'auto', or 'uid' / 'user' / 'none' to ask for less). Returns (layers,
    in_pid_namespace). Called in the harness before anything of the program runs."""
    libc, layers = _libc(), []
    uid, limits, mode = header["uid"], header["limits"], header.get("isolation", "auto")
    header["drop_root"] = mode in ("auto", "uid") and os.geteuid() == 0
    if mode in ("none", "uid"):
        pass
    elif header["drop_root"]:
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


_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
_MNT_DETACH = 2


def _pivot_root(mount_point, layers):
    """Make the tmpfs at `mount_point` the mount namespace's root and detach the old root (nothing of
    the host is left in the namespace), then chroot into its JAIL. The chroot matters too: the kernel
    refuses a chrooted process a new user namespace (where it would regain capabilities), and its
    escapes need CAP_SYS_CHROOT, which the program never has. Where pivot_root is unknown or refused:
    the chroot alone."""
    libc, number = _libc(), _SYS_PIVOT_ROOT.get(os.uname().machine)
    os.chdir(mount_point)
    if number is not None and libc.syscall(number, b".", b".") == 0:
        _check(libc.umount2(b".", _MNT_DETACH), "umount the old root")
        os.chdir("/")
        os.chroot(JAIL)
        layers.append("pivot_root")
    else:
        os.chroot(mount_point + JAIL)


def _enter(header, layers):
    """In the PID namespace's init: chroot, rlimits, drop to the sandbox uid (order matters)."""
    import resource
    lim = header["limits"]
    if "chroot" in layers:
        _pivot_root(os.getcwd(), layers)
        os.chdir("/work")
    mb = 1 << 20
    for res, value in ((resource.RLIMIT_AS, lim["memory_mb"] * mb), (resource.RLIMIT_NOFILE, lim["nofile"]),
                       (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, lim["nproc"])):
        resource.setrlimit(res, (value, value))
    if header["drop_root"]:
        if "chroot" not in layers:
            # without the chroot's bind of the interpreter, its files may be closed to the new uid
            # (e.g. under /root): load what a case needs after the fork now
            import linecache, traceback  # noqa: F401
        uid = header["uid"]
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        layers.append("uid")
    _libc().prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    layers.append("rlimits")


def main():
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


# Linux signal numbers (the `signal` module is not imported: it costs the harness milliseconds per program)
SIGABRT, SIGKILL, SIGSEGV, SIGXCPU, SIGXFSZ = 6, 9, 11, 24, 25
_SIGNALS = {SIGXFSZ: ("SIGXFSZ", "output limit"), SIGXCPU: ("SIGXCPU", "CPU time limit"), SIGKILL: ("SIGKILL", "killed"),
            SIGSEGV: ("SIGSEGV", "segmentation fault: memory or recursion"), SIGABRT: ("SIGABRT", "aborted")}


def _run_case(header, case, own_tree):
    """Fork, run program + case code in the child with the case's stdin; collect status and output."""
    lim = header["limits"]
    fds = {name: os.memfd_create(name) for name in ("stdin", "stdout", "stderr", "done")}
    data = case["stdin"].encode("utf-8", "replace")
    while data:
        data = data[os.write(fds["stdin"], data):]
    os.lseek(fds["stdin"], 0, 0)
    nonce = os.urandom(16).hex()
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
        name, what = _SIGNALS.get(-code, (f"signal {-code}", "a signal"))
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
            os.kill(target, SIGKILL)
        except OSError:
            pass


def _kill_tree(pid, own_tree):
    """Kill what the case left behind (forked children, daemons) and reap the zombies. kill(-1)
    reaches every process this uid / PID namespace may signal: only the program's own."""
    _kill(pid)
    if own_tree:
        try:
            os.kill(-1, SIGKILL)
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
    sys.exit(main())
