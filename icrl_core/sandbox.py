"""Run untrusted Python programs (model-written code) in their own process, contained.

Each program runs in its own process, forked from a warm `python -I -S -B` zygote (`_ZYGOTE` below) by a small
trusted bootstrap that sets the containment up before the program's first line runs. Two mechanisms, chosen by
`SandboxConfig.isolation`:

- `namespaces` (needs CAP_SYS_ADMIN, e.g. root in a container): new network, mount, PID, IPC and UTS
  namespaces; a size-capped tmpfs root holding read-only binds of /usr and the Python installation plus an empty
  working directory, entered with chroot (no /proc, /sys, /home, /root or project folder inside); the program is
  PID 1 of its PID namespace, so when it dies the kernel kills every process it started (setsid or double forks
  do not escape); it runs under a dedicated unprivileged uid per worker slot (`slot_uid`), so
  RLIMIT_NPROC counts only that slot's processes (root ignores RLIMIT_NPROC) and it cannot signal or read
  anything of other users.
- `audit_hook` (fallback, any user): the same process and resource limits, an empty temporary working
  directory, and a `sys.addaudithook` hook in the program's interpreter that refuses sockets, opening files
  outside the working directory and the Python installation, signalling other processes, and ctypes. A
  determined program can escape an audit hook (e.g. through a C extension); docs/SANDBOX.md says what is not
  isolated.

`auto` picks `namespaces` where the kernel allows it. Every result says which mechanism ran.

Both apply RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC, RLIMIT_NOFILE, RLIMIT_FSIZE (and no core files), a wall-clock
timeout enforced by the bootstrap (SIGKILL to the program) and by the caller (SIGKILL to the whole process group),
a minimal environment, and capped stdout/stderr (reading stops and the program is killed past the cap).
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

from icrl_core.code_config import SandboxConfig

Status = Literal["ok", "failed", "timeout", "memory", "killed", "output_limit", "error"]


@dataclass(frozen=True)
class SandboxResult:
    """What one program did. status: ok (exit 0), failed (exit != 0), timeout (wall clock or CPU time), memory
    (MemoryError), killed (a signal), output_limit (stdout/stderr past the cap), error (the sandbox could not
    start the program)."""

    status: Status
    reason: str
    returncode: int | None
    stdout: str
    stderr: str
    wall_seconds: float
    isolation: str

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# ---------------------------------------------------------------------------------------------------------------
# The zygote: trusted code run once per calling process and isolation as `python -I -S -B -c _ZYGOTE FD`, as the
# caller's user. It imports what programs and the harness commonly need once, then for each request on the unix
# socket FD (a settings dict literal plus the program's stdin, stdout, stderr and a status pipe) forks a
# bootstrap: a new session that sets the containment up, forks the program's process, enforces the wall clock
# on it and reports on the status pipe (one line with its process group, one with the program's pid, one with
# how it ended). Forking a warm interpreter instead of starting one per program is what makes the sandbox
# about as fast as a bare subprocess. Only the standard library; nothing of the project.

_ZYGOTE = r'''
import ast, atexit, ctypes, json, os, resource, select, signal, socket, sys, time, traceback
def bootstrap(S, status):
    work, namespaces = S["work"], S["isolation"] == "namespaces"
    def report(line):
        os.write(status, (line + "\n").encode())
    report('{"group": %d}' % os.getpgrp())
    if namespaces:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
        def ok(rc, what):
            if rc != 0:
                e = ctypes.get_errno()
                raise OSError(e, what + ": " + os.strerror(e))
        def mount(src, dst, fstype, flags, data=None):
            ok(libc.mount(src and src.encode(), dst.encode(), fstype and fstype.encode(), flags,
                          data and data.encode()), "mount " + dst)
        MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
        # network, mount, PID, IPC, UTS namespaces; the next fork is PID 1 of the new PID namespace
        ok(libc.unshare(0x40000000 | 0x00020000 | 0x20000000 | 0x08000000 | 0x04000000), "unshare")
        mount(None, "/", None, MS_REC | MS_PRIVATE)
        root, uid = S["root"], S["uid"]
        mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=%dk,mode=755" % S["disk_kb"])
        for src in S["binds"]:
            dst = root + src
            if os.path.islink(src):
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                os.symlink(os.readlink(src), dst)
                continue
            os.makedirs(dst, exist_ok=True)
            mount(src, dst, None, MS_BIND | MS_REC)
            mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        os.mkdir(root + "/dev")
        for dev in ("null", "zero", "urandom", "random"):
            open(root + "/dev/" + dev, "w").close()
            mount("/dev/" + dev, root + "/dev/" + dev, None, MS_BIND)
        os.mkdir(root + "/tmp")
        os.chmod(root + "/tmp", 0o1777)
        os.mkdir(root + "/sandbox", 0o700)
        for name in os.listdir(work):
            with open(work + "/" + name, "rb") as f, open(root + "/sandbox/" + name, "wb") as g:
                g.write(f.read())
            os.chown(root + "/sandbox/" + name, uid, uid)
        os.chown(root + "/sandbox", uid, uid)
        os.chroot(root)
        work = "/sandbox"
    os.chdir(work)
    pid = os.fork()
    if pid == 0:
        os.close(status)
        for name, limit in S["limits"].items():
            resource.setrlimit(getattr(resource, name), limit)
        if namespaces:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG (after setuid, which clears it)
            libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
            del libc, mount, ok
        else:
            # fallback containment: refuse sockets, ctypes, new processes, files outside the working directory and
            # the Python installation, and signals to other processes
            def install_audit_hook(allowed, own, blocked):
                realpath, join, cwd, fsdecode = os.path.realpath, os.path.join, os.getcwd(), os.fsdecode
                def hook(event, args):
                    if event.startswith(("socket.", "ctypes.")) or event in blocked:
                        raise PermissionError("sandbox: " + event + " is not allowed")
                    if event == "open" and not isinstance(args[0], int):
                        path = realpath(join(cwd, fsdecode(args[0])))
                        if not any(path == a or path.startswith(a + "/") for a in allowed):
                            raise PermissionError("sandbox: no access to " + path)
                    elif event == "os.kill" and args[0] not in (0, own):
                        raise PermissionError("sandbox: signals to other processes are not allowed")
                sys.addaudithook(hook)
            install_audit_hook((S["prefix"], os.getcwd(), "/dev/null", "/dev/urandom"), os.getpid(),
                               ("os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                                "os.forkpty"))
        os.environ.clear()
        os.environ.update(S["env"])
        # The program runs in this forked, already contained interpreter as a fresh __main__ module (one interpreter
        # start per program, not two); the working directory is on sys.path so tests can import a solution module.
        # It ends with os._exit after flushing (atexit handlers run; the interpreter's slow teardown is skipped).
        del S, report, status
        main = type(sys)("__main__")
        main.__file__ = "main.py"
        sys.modules["__main__"] = main
        sys.argv = ["main.py"]
        sys.path.insert(0, ".")
        try:
            with open("main.py", "rb") as f:
                code = compile(f.read(), "main.py", "exec")
            del f
            exec(code, main.__dict__)
            exit_code = 0
        except SystemExit as e:
            exit_code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            exit_code = 1
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(exit_code & 0xFF)
    report('{"pid": %d}' % pid)
    fd = os.pidfd_open(pid)
    timed_out = not select.select([fd], [], [], S["wall_seconds"])[0]
    if timed_out:
        os.kill(pid, signal.SIGKILL)
    _, code = os.waitpid(pid, 0)
    report('{"timeout": %s, "exit": %d}' % ("true" if timed_out else "false", os.waitstatus_to_exitcode(code)))
    os._exit(0)

channel = socket.socket(fileno=int(sys.argv[1]))
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # bootstraps are reaped by the kernel
while True:
    try:
        message, fds, _, _ = socket.recv_fds(channel, 1 << 20, 4)
    except OSError:
        break
    if not message:  # the caller closed its end (or died): no more programs
        break
    try:
        pid = os.fork()
    except OSError:  # the caller sees the status pipe close without a report: status "error"
        pid = -1
    if pid == 0:
        try:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            channel.close()
            os.setsid()
            for target, fd in enumerate(fds[:3]):
                os.dup2(fd, target)
                os.close(fd)
            bootstrap(eval(message.decode(), {"__builtins__": {}}), fds[3])  # a dict literal from the caller
        except BaseException:
            traceback.print_exc()
        os._exit(70)
    for fd in fds:
        os.close(fd)
'''


@cache
def namespaces_available() -> bool:
    """Whether this process may create network/mount/PID namespaces and chroot (CAP_SYS_ADMIN, CAP_SYS_CHROOT,
    CAP_SETUID): checked once by running a trivial program with them."""
    if os.geteuid() != 0 or not hasattr(os, "pidfd_open"):
        return False
    result = _run_one("pass", SandboxConfig(isolation="namespaces", wall_seconds=10), "namespaces", slot=0)
    return result.ok


def resolve_isolation(config: SandboxConfig) -> str:
    if config.isolation == "auto":
        if namespaces_available():
            return "namespaces"
        if os.geteuid() == 0:
            # root without namespaces: the weak fallback, where RLIMIT_NPROC does not even apply
            warnings.warn("sandbox: namespaces are unavailable, running programs under the audit-hook fallback "
                          "(see docs/SANDBOX.md)", RuntimeWarning, stacklevel=2)
        return "audit_hook"
    return config.isolation


def _python() -> str:
    # The base interpreter, not the project's venv: the program sees the standard library only.
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def _binds() -> list[str]:
    """Host paths the namespaces sandbox sees (read-only): the system libraries and the Python installation."""
    paths = ["/usr", "/bin", "/lib", "/lib64", "/sbin", sys.base_prefix]
    return [p for p in dict.fromkeys(paths) if os.path.lexists(p)]


def slot_uid(config: SandboxConfig, slot: int) -> int:
    """The uid of worker slot `slot` under namespaces: distinct per slot and per calling process, so RLIMIT_NPROC
    of one program never counts another caller's programs."""
    return config.uid_base + (os.getpid() % 4096) * 64 + slot


def _user_process_count() -> int:
    uid = os.getuid()
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += 1
            except OSError:
                pass
    return count


def _limits(config: SandboxConfig, isolation: str) -> dict[str, tuple[int, int]]:
    nproc = config.max_processes
    if isolation != "namespaces":
        # RLIMIT_NPROC counts all processes of the real uid: leave room for the ones this user already runs.
        nproc += _user_process_count()
    mib = 1 << 20
    return {
        "RLIMIT_CPU": (config.cpu_seconds, config.cpu_seconds + 1),
        "RLIMIT_AS": (config.memory_mb * mib, config.memory_mb * mib),
        "RLIMIT_NPROC": (nproc, nproc),
        "RLIMIT_NOFILE": (config.max_open_files, config.max_open_files),
        "RLIMIT_FSIZE": (int(config.max_file_mb * mib), int(config.max_file_mb * mib)),
        "RLIMIT_CORE": (0, 0),
    }


def _kill_group(group: int | None, program_pid: int | None, isolation: str) -> None:
    """SIGKILL the bootstrap's process group; under audit_hook also the program itself (it may have left the
    group with setsid). Under namespaces the program dies with the bootstrap (PR_SET_PDEATHSIG) and takes its
    PID namespace with it."""
    for kill, target in ((os.killpg, group), (os.kill, program_pid)):
        if target is None or (kill is os.kill and isolation == "namespaces"):
            continue
        try:
            kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class _Zygote:
    """One warm zygote process (see _ZYGOTE) and the socket its requests go through."""

    def __init__(self) -> None:
        self.channel, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.pid = os.getpid()
        self.proc = subprocess.Popen(
            [_python(), "-I", "-S", "-B", "-c", _ZYGOTE, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        )
        theirs.close()
        self.lock = threading.Lock()

    def usable(self) -> bool:
        return self.pid == os.getpid() and self.proc.poll() is None

    def request(self, settings: dict, fds: list[int]) -> None:
        with self.lock:
            socket.send_fds(self.channel, [repr(settings).encode()], fds)

    def close(self) -> None:
        self.channel.close()  # the zygote exits on end of file
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_zygotes: dict[str, _Zygote] = {}
_zygotes_lock = threading.Lock()


def _zygote(isolation: str) -> _Zygote:
    with _zygotes_lock:
        zygote = _zygotes.get(isolation)
        if zygote is None or not zygote.usable():
            zygote = _zygotes[isolation] = _Zygote()
        return zygote


@atexit.register
def _close_zygotes() -> None:
    with _zygotes_lock:
        for zygote in _zygotes.values():
            if zygote.pid == os.getpid():
                zygote.close()
        _zygotes.clear()


def _classify(end: dict | None, stderr: str, config: SandboxConfig) -> tuple[Status, str, int | None]:
    if end is None:
        return "error", "the sandbox bootstrap ended without a report", None
    code = end["exit"]
    if end["timeout"]:
        return "timeout", f"wall-clock timeout ({config.wall_seconds:g} s): killed", code
    if code == 0:
        return "ok", "exit 0", code
    if code < 0:
        sig = signal.Signals(-code)
        if sig == signal.SIGXCPU:
            return "timeout", f"CPU-time limit ({config.cpu_seconds} s): {sig.name}", code
        return "killed", f"killed by {sig.name}", code
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if last.startswith("MemoryError"):
        return "memory", f"address-space limit ({config.memory_mb} MiB): MemoryError", code
    return "failed", f"exit {code}" + (f": {last[:300]}" if last else ""), code


def _run_one(source: str, config: SandboxConfig, isolation: str, slot: int, stdin: bytes = b"",
             files: dict[str, str] | None = None) -> SandboxResult:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="icrl-sandbox-") as tmp:
        work = Path(tmp, "work")
        work.mkdir()
        Path(tmp, "root").mkdir()
        (work / "main.py").write_text(source, encoding="utf-8")
        for name, text in (files or {}).items():
            if "/" in name or name.startswith("."):
                raise ValueError(f"sandbox file names are plain names, got {name!r}")
            (work / name).write_text(text, encoding="utf-8")
        audit = isolation == "audit_hook"
        settings = {
            "isolation": isolation, "work": str(work), "root": str(Path(tmp, "root")), "binds": _binds(),
            "disk_kb": config.disk_mb * 1024, "uid": slot_uid(config, slot), "limits": _limits(config, isolation),
            "wall_seconds": config.wall_seconds, "prefix": sys.base_prefix,
            "env": {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(work) if audit else "/sandbox",
                    "PYTHONIOENCODING": "utf-8"},
        }
        stdin_read, stdin_write = os.pipe()
        stdout_read, stdout_write = os.pipe()
        stderr_read, stderr_write = os.pipe()
        status_read, status_write = os.pipe()
        theirs = [stdin_read, stdout_write, stderr_write, status_write]
        try:
            _zygote(isolation).request(settings, theirs)
        finally:
            for fd in theirs:
                os.close(fd)
        threading.Thread(target=_feed, args=(stdin_write, stdin), daemon=True).start()
        return _collect(stdout_read, stderr_read, status_read, config, isolation, started)


def _feed(fd: int, data: bytes) -> None:
    try:
        with open(fd, "wb", buffering=0) as pipe:
            pipe.write(data)
    except OSError:  # the program exited or closed stdin
        pass


def _collect(stdout: int, stderr: int, status: int, config: SandboxConfig, isolation: str,
             started: float) -> SandboxResult:
    """Read stdout/stderr (capped) and the bootstrap's status lines until all three pipes close; kill the
    bootstrap's process group on the hard deadline (its own timeout plus a grace period) or past the output
    cap."""
    deadline = started + config.wall_seconds + 3.0
    buffers = {stdout: bytearray(), stderr: bytearray(), status: bytearray()}
    sel = selectors.DefaultSelector()
    for fd in buffers:
        sel.register(fd, selectors.EVENT_READ)
    verdict: tuple[Status, str] | None = None
    try:
        while sel.get_map() and verdict is None:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                verdict = ("timeout", f"wall-clock timeout ({config.wall_seconds:g} s): the sandbox did not "
                                      "answer, process group killed")
                break
            for key, _ in sel.select(timeout=remaining):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buffers[key.fd] += chunk
                if key.fd != status and len(buffers[key.fd]) > config.max_output_bytes:
                    name = "stdout" if key.fd == stdout else "stderr"
                    verdict = ("output_limit", f"{name} exceeded {config.max_output_bytes} bytes: killed")
                    break
    finally:
        sel.close()
        found = {}
        for line in buffers[status].decode("utf-8", "replace").splitlines():
            try:
                found.update(json.loads(line))
            except ValueError:  # a line cut short by a kill
                pass
        if verdict:
            _kill_group(found.get("group"), found.get("pid"), isolation)
        for fd in buffers:
            os.close(fd)
    out, err = (bytes(buffers[fd][: config.max_output_bytes]).decode("utf-8", "replace") for fd in (stdout, stderr))
    end = found if "exit" in found else None
    if verdict:
        status_name, reason = verdict
        code = end["exit"] if end else None
    else:
        status_name, reason, code = _classify(end, err, config)
        if status_name == "error" and err.strip():
            reason += ": " + err.strip().splitlines()[-1][:300]
    return SandboxResult(status=status_name, reason=reason, returncode=code, stdout=out, stderr=err,
                         wall_seconds=time.perf_counter() - started, isolation=isolation)


def run_program(source: str, config: SandboxConfig | None = None, stdin: str = "",
                files: dict[str, str] | None = None) -> SandboxResult:
    """Run one Python program (the text of main.py; `files` are extra files beside it) in the sandbox."""
    return run_programs([source], config, stdins=[stdin], files=[files])[0]


def run_programs(sources: list[str], config: SandboxConfig | None = None, stdins: list[str] | None = None,
                 files: list[dict[str, str] | None] | None = None) -> list[SandboxResult]:
    """Run programs in the sandbox, up to `config.workers` at once; results in the order of `sources`."""
    config = config or SandboxConfig()
    isolation = resolve_isolation(config)
    stdins = stdins or [""] * len(sources)
    files = files or [None] * len(sources)
    slots: list[int] = list(range(config.workers))
    lock = threading.Lock()

    def run(index: int) -> SandboxResult:
        with lock:
            slot = slots.pop()
        try:
            return _run_one(sources[index], config, isolation, slot, stdins[index].encode(), files[index])
        finally:
            with lock:
                slots.append(slot)

    if len(sources) <= 1 or config.workers == 1:
        return [run(i) for i in range(len(sources))]
    with ThreadPoolExecutor(max_workers=config.workers) as pool:
        return list(pool.map(run, range(len(sources))))


def rlimit_names() -> list[str]:
    """The resource limits every sandboxed process gets (for docs and reports)."""
    return [name for name in _limits(SandboxConfig(), "namespaces") if hasattr(resource, name)]
