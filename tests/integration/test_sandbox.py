"""The sandbox and the code reward against hostile programs: each attack ends with reward 0 and a recorded reason
within its timeout, and leaves the test process, the host's files and the machine alone. Every attack runs
under the mechanism this machine gives (`auto`: namespaces where allowed) and the safe ones also under the
audit-hook fallback. Real processes, real sockets, real files; no mocks."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from icrl_core.code_reward import CodeConfig, score, score_many
from icrl_core.code_tasks import code_tasks
from icrl_core.sandbox import SandboxConfig, namespaces_available, resolve_isolation, run_program, slot_uid
from tests.conftest import ROOT

WALL = 2.0
LIMITS = {"wall_seconds": WALL, "cpu_seconds": 2, "memory_mb": 256, "max_processes": 8,
          "max_output_bytes": 1 << 16}
TASK = next(t for t in code_tasks() if t.template == "add_constant")  # def add_K(x: int) -> int
K = int(TASK.name.split("_")[1])


def config(isolation: str = "auto") -> CodeConfig:
    return CodeConfig(sandbox=SandboxConfig(isolation=isolation, **LIMITS))


def candidate(body: str, head: str = "import os, sys, socket") -> str:
    """A solution of TASK that runs `body` first and answers correctly if the attack did not stop it."""
    lines = "\n".join("    " + line for line in body.strip().splitlines())
    return f"{head}\n\n\n{TASK.signature}\n    \"\"\"Add.\"\"\"\n{lines}\n    return x + {K}\n"


@pytest.fixture(scope="module")
def listener():
    """A real TCP server on the host's loopback: a sandboxed program must not reach it."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    yield server
    server.close()


def assert_zero(breakdown, *reason_parts: str, within: float = WALL + 3.0):
    assert breakdown.total == 0.0, breakdown
    assert breakdown.tests_passed == 0, breakdown
    assert breakdown.reason, breakdown
    for part in reason_parts:
        assert part in breakdown.reason, (part, breakdown.reason)


def sandbox_processes() -> list[int]:
    """Processes still running under a sandbox uid of this test process."""
    uids = {slot_uid(SandboxConfig(), slot) for slot in range(64)}
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid in uids:
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_a_correct_solution_earns_the_full_reward():
    breakdown = score(TASK.reference, TASK, config())
    assert breakdown.status == "ok" and breakdown.tests_passed == len(TASK.tests)
    assert breakdown.components["pass_fraction"] == 1.0 and breakdown.components["all_pass"] == 1.0
    assert breakdown.total > 2.0
    assert breakdown.isolation == resolve_isolation(config().sandbox)


def test_partial_credit_and_named_components():
    half = candidate(f"if x % 2:\n    return x - {K}")  # right on even inputs only
    breakdown = score(half, TASK, config())
    assert 0 < breakdown.tests_passed < len(TASK.tests)
    assert breakdown.components["pass_fraction"] == pytest.approx(breakdown.tests_passed / len(TASK.tests))
    assert breakdown.components["all_pass"] == 0.0 and breakdown.components["time_efficiency"] == 0.0
    assert 0 < breakdown.total < 1.5
    no_doc = TASK.prompt.split('    """')[0] + f"    return x + {K}\n"
    assert score(no_doc, TASK, config()).components["docstring"] == 0.0
    assert score(TASK.reference + "import os\n", TASK, config()).components["lint"] < 1.0  # F401, E402


def test_infinite_loop_times_out():
    started = time.perf_counter()
    breakdown = score(candidate("while True:\n    pass"), TASK, config())
    assert_zero(breakdown, "timeout")
    assert time.perf_counter() - started < WALL + 3.0


def test_fork_bomb_is_contained_and_cleaned_up():
    if resolve_isolation(config().sandbox) != "namespaces":
        pytest.skip("without a PID namespace and a dedicated uid a fork bomb is only refused by the audit hook")
    bomb = "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    started = time.perf_counter()
    breakdown = score(candidate(bomb), TASK, config())
    assert_zero(breakdown, "timeout")
    assert time.perf_counter() - started < WALL + 3.0
    time.sleep(0.2)
    assert sandbox_processes() == []  # the PID namespace died with its first process


def test_fork_bomb_under_the_audit_hook_is_refused():
    bomb = "while True:\n    os.fork()"
    breakdown = score(candidate(bomb), TASK, config("audit_hook"))
    assert_zero(breakdown, "PermissionError", "os.fork")


@pytest.mark.parametrize("isolation", ["auto", "audit_hook"])
def test_memory_bomb_hits_the_address_space_limit(isolation):
    growing = "import os, sys\nhog = []\nwhile True:\n    hog.append(bytes(1 << 24))"  # at import (calloc: no page touched)
    assert_zero(score(candidate("pass", head=growing), TASK, config(isolation)), "MemoryError")
    assert_zero(score(candidate("hog = bytearray(1 << 34)"), TASK, config(isolation)), "MemoryError")


@pytest.mark.parametrize("isolation", ["auto", "audit_hook"])
def test_network_connection_fails(isolation, listener):
    port = listener.getsockname()[1]
    attack = f"socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')"
    breakdown = score(candidate(attack), TASK, config(isolation))
    assert_zero(breakdown)
    assert any(word in breakdown.reason for word in ("ConnectionRefused", "OSError", "PermissionError")), breakdown
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing reached the host's loopback
    # and outside the machine
    assert_zero(score(candidate("socket.create_connection(('1.1.1.1', 53), timeout=1)"), TASK, config(isolation)))


@pytest.mark.parametrize("isolation", ["auto", "audit_hook"])
def test_writing_outside_the_sandbox_fails(isolation, tmp_path):
    target = tmp_path / "written-by-sandbox.txt"
    breakdown = score(candidate(f"open({str(target)!r}, 'w').write('x')"), TASK, config(isolation))
    assert_zero(breakdown)
    assert not target.exists()


@pytest.mark.parametrize("isolation", ["auto", "audit_hook"])
def test_reading_a_project_file_fails(isolation):
    project_file = ROOT / "pyproject.toml"
    assert project_file.exists()
    breakdown = score(candidate(f"open({str(project_file)!r}).read()"), TASK, config(isolation))
    assert_zero(breakdown)
    if isolation == "audit_hook":
        assert "PermissionError" in breakdown.reason
    elif resolve_isolation(config().sandbox) == "namespaces":
        assert "FileNotFoundError" in breakdown.reason  # not even visible


@pytest.mark.parametrize("isolation", ["auto", "audit_hook"])
def test_killing_the_parent_process_fails(isolation):
    attack = f"os.kill({os.getpid()}, 9)\nos.kill(os.getppid(), 9)"
    breakdown = score(candidate(attack), TASK, config(isolation))
    assert_zero(breakdown)
    os.kill(os.getpid(), 0)  # still here


@pytest.mark.parametrize("isolation", ["auto", "audit_hook"])
def test_printing_a_gigabyte_is_cut_off(isolation):
    started = time.perf_counter()
    attack = "for _ in range(1024):\n    sys.stdout.write('x' * (1 << 20))"
    breakdown = score(candidate(attack), TASK, config(isolation))
    assert_zero(breakdown, "output_limit", "stdout exceeded")
    assert time.perf_counter() - started < WALL


@pytest.mark.parametrize("isolation", ["auto", "audit_hook"])
def test_sys_exit_inside_a_test(isolation):
    breakdown = score(candidate("sys.exit(0)"), TASK, config(isolation))
    assert_zero(breakdown, "SystemExit")
    # os._exit skips the harness's report altogether
    assert_zero(score(candidate("os._exit(0)"), TASK, config(isolation)), "no test report")


@pytest.mark.parametrize("isolation", ["auto", "audit_hook"])
def test_closing_stdout(isolation):
    assert_zero(score(candidate("os.close(1)"), TASK, config(isolation)))
    assert_zero(score(candidate("sys.stdout.close()"), TASK, config(isolation)))


def test_a_forged_equality_does_not_pass():
    forged = candidate("class Anything(int):\n    def __eq__(self, other):\n        return True\nreturn Anything(0)")
    assert_zero(score(forged, TASK, config()), "wrong answer")


def test_attacks_in_parallel_do_not_disturb_honest_programs():
    programs = [TASK.reference, candidate("while True:\n    pass"), TASK.reference, candidate("os._exit(3)"),
                TASK.reference, candidate("hog = bytearray(1 << 34)")]
    breakdowns = score_many(programs, [TASK] * len(programs), config())
    assert [b.total > 2 for b in breakdowns] == [True, False, True, False, True, False]


def test_sandbox_statuses_and_isolation():
    sandbox = SandboxConfig(**LIMITS)
    result = run_program("print('hi')", sandbox)
    assert (result.status, result.stdout, result.returncode) == ("ok", "hi\n", 0)
    assert result.isolation in ("namespaces", "audit_hook")
    assert run_program("raise SystemExit(3)", sandbox).status == "failed"
    assert run_program("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", sandbox).status in (
        "killed", "ok")  # PID 1 of a namespace ignores signals it has no handler for
    assert run_program("import resource\nwhile True: pass", sandbox).status == "timeout"
    if namespaces_available():
        seen = run_program("import json, os; print(json.dumps([sorted(os.listdir('/')), os.getcwd(), "
                           "sorted(os.environ), os.getuid()]))", sandbox)
        listing, cwd, env_keys, uid = json.loads(seen.stdout)
        assert set(listing) <= {"usr", "bin", "lib", "lib64", "sbin", "root", "dev", "tmp", "sandbox"}, listing
        assert cwd == "/sandbox" and uid != 0
        assert env_keys == ["HOME", "LANG", "PATH", "PYTHONIOENCODING"]
