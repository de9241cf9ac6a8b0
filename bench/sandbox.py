"""Benchmark: sandboxed test executions per second vs a bare subprocess, same programs, same worker count.

A "program" is a code task's reference solution with the test harness (icrl_core/code_reward.py): one process
runs all 6 hidden tests of its task. Three ways to run the same N programs with W workers (threads that each
start one process at a time):

- `sandbox_<isolation>`: icrl_core.sandbox.run_programs (namespaces and/or the audit-hook fallback)
- `bare_subprocess`: `python -I -S` on the same harness and solution in a temporary folder, no limits, no
  isolation (what running model code without a sandbox would cost)

Reported: programs/s and test executions/s of each, and the sandbox's throughput as a share of the bare
subprocess's. The variants take turns on chunks of the programs (`--rounds`), so drifting load on the shared
machine hits them alike; the load average is recorded, since absolute rates vary with it.

    .venv/bin/python bench/sandbox.py            # table + bench/results/sandbox.json
    .venv/bin/python bench/sandbox.py --n 200 --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from icrl_core.code_reward import _HARNESS, harness_input, parse_report
from icrl_core.code_tasks import code_tasks
from icrl_core.io import atomic_write_json
from icrl_core.sandbox import SandboxConfig, _python, namespaces_available, run_programs


def bare(program: str, stdin: str) -> str:
    with tempfile.TemporaryDirectory(prefix="icrl-bare-") as tmp:
        Path(tmp, "solution.py").write_text(program)
        # as in the sandbox: the working directory on sys.path, the harness as __main__
        out = subprocess.run([_python(), "-I", "-S", "-B", "-c", "import sys; sys.path.insert(0, '.')\n" + _HARNESS],
                             input=stdin, check=False, capture_output=True, text=True, cwd=tmp, timeout=30)
        return out.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=120, help="programs per variant")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6, help="turns the variants take on chunks of programs")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "sandbox.json")
    args = parser.parse_args()

    tasks = [code_tasks()[i % len(code_tasks())] for i in range(0, args.n * 7, 7)][: args.n]
    load_before = os.getloadavg()

    def sandboxed(isolation: str):
        def run(chunk):
            config = SandboxConfig(isolation=isolation, workers=args.workers)
            nonces = [secrets.token_hex(16) for _ in chunk]
            results = run_programs([_HARNESS] * len(chunk), config,
                                   stdins=[harness_input(t, n) for t, n in zip(chunk, nonces)],
                                   files=[{"solution.py": t.reference} for t in chunk])
            return all(all(parse_report(r, n).passed) and r.ok for r, n in zip(results, nonces))
        return run

    def bare_run(chunk):
        nonces = [secrets.token_hex(16) for _ in chunk]
        with ThreadPoolExecutor(args.workers) as pool:
            outs = list(pool.map(bare, [t.reference for t in chunk],
                                 [harness_input(t, n) for t, n in zip(chunk, nonces)]))
        reports = [json.loads(o.split(n, 1)[1]) for o, n in zip(outs, nonces)]
        return all(r.get("results") and all(row[0] for row in r["results"]) for r in reports)

    variants = {"bare_subprocess": bare_run}
    if namespaces_available():
        variants["sandbox_namespaces"] = sandboxed("namespaces")
    variants["sandbox_audit_hook"] = sandboxed("audit_hook")
    # The machine is shared and its load drifts: the variants take turns on chunks of the programs, so each
    # sees the same mix of quiet and busy moments.
    seconds = dict.fromkeys(variants, 0.0)
    passed = dict.fromkeys(variants, True)
    chunk_size = max(1, len(tasks) // args.rounds)
    for start in range(0, len(tasks), chunk_size):
        chunk = tasks[start:start + chunk_size]
        for name, run in variants.items():
            began = time.perf_counter()
            passed[name] &= run(chunk)
            seconds[name] += time.perf_counter() - began
    n_tests = sum(len(t.tests) for t in tasks)
    rows = [{"variant": name, "programs": len(tasks), "seconds": round(seconds[name], 3),
             "programs_per_s": round(len(tasks) / seconds[name], 2), "tests_per_s": round(n_tests / seconds[name], 1),
             "all_tests_passed": passed[name]} for name in variants]
    for row in rows:
        print(f"{row['variant']:22s} {row['programs_per_s']:7.2f} programs/s {row['tests_per_s']:8.1f} tests/s "
              f"(all passed: {row['all_tests_passed']})")
    baseline = rows[0]["programs_per_s"]
    for row in rows[1:]:
        row["share_of_bare_throughput"] = round(row["programs_per_s"] / baseline, 3)
        print(f"{row['variant']}: {row['share_of_bare_throughput']:.2f} x the bare subprocess's throughput")
    result = {"workers": args.workers, "rounds": args.rounds, "cpu_count": os.cpu_count(),
              "tests_per_program": n_tests / len(tasks),
              "load_average_before": [round(x, 2) for x in load_before],
              "load_average_after": [round(x, 2) for x in os.getloadavg()], "goal_programs_per_s": 20,
              "rows": rows}
    atomic_write_json(args.output, result)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
