"""Rewards for model-written code: run a candidate function against a task's hidden tests in the sandbox, and score
it as named, weighted components.

    reward = reward_scale * gate * max(0, sum_c w_c * component_c - w_length * length_penalty)

components (each in [0, 1]):
    pass_fraction    tests passed / tests                       (partial credit)
    all_pass         1 if every test passed
    time_efficiency  all_pass * max(0, 1 - test time / task.time_budget_ms)
    lint             1 / (1 + ruff findings)                     (ruff, pyflakes + pycodestyle rules)
    docstring        1 if the task's function has a docstring
    complexity       min(1, complexity_target / cyclomatic complexity of the function)   (radon)
    reward_model     a reward model's score in [0, 1] when one is given, else 0
    length_penalty   min(1, max(0, chars / (length_ratio * reference chars) - 1))
gate = 1 if the program ran (sandbox status ok), reported its results, and passed at least one test, else 0: a
broken or hostile program earns nothing, however tidy, and every zero has a recorded reason.

One sandbox process per program runs every test inside it (`main.py` is the harness, the candidate is
`solution.py`). The tests and a per-run nonce reach the harness on stdin, not on disk; results are compared with
exact types (an object with a forged `__eq__` does not pass). The harness shares the candidate's process, so a
program written to attack the harness through introspection could forge its report: see docs/SANDBOX.md.
"""

from __future__ import annotations

import ast
import json
import secrets
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from icrl_core.code_config import CodeConfig, CodeRewardConfig, CodeRewardWeights, SandboxConfig  # noqa: F401
from icrl_core.code_tasks import CodeTask
from icrl_core.sandbox import SandboxResult, run_programs

COMPONENTS = ("pass_fraction", "all_pass", "time_efficiency", "lint", "docstring", "complexity", "reward_model")


# ---------------------------------------------------------------------------------------------------------------
# The harness: main.py in the sandbox. Reads the nonce and the tests from stdin before importing the candidate.

_HARNESS = r'''
import sys, time
from ast import literal_eval
def _read():
    nonce = sys.stdin.readline().strip()
    name = sys.stdin.readline().strip()
    tests = literal_eval(sys.stdin.readline())
    return nonce, name, tests
_nonce, _name, _tests = _read()
_write, _flush = sys.stdout.write, sys.stdout.flush
def _same(a, b):
    if type(a) is not type(b):
        return False
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b
def _run():
    try:
        import solution
        fn = getattr(solution, _name)
    except BaseException as e:
        return {"error": "%s: %s" % (type(e).__name__, str(e)[:200])}
    results = []
    for args, expected in _tests:
        started = time.perf_counter()
        try:
            got = fn(*args)
            ok = _same(got, expected)
            why = "" if ok else "wrong answer"
        except BaseException as e:  # SystemExit and KeyboardInterrupt too: one test fails, the others run
            ok, why = False, "%s: %s" % (type(e).__name__, str(e)[:200])
        results.append([ok, time.perf_counter() - started, why])
    return {"results": results}
_report = _run()
import json
_write(_nonce + json.dumps(_report) + "\n")
_flush()
'''


@dataclass(frozen=True)
class HarnessReport:
    """What the harness reported: per test (passed, seconds, why not). `error` if it reported nothing usable."""

    passed: list[bool] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    why: list[str] = field(default_factory=list)
    error: str = ""


@dataclass(frozen=True)
class RewardBreakdown:
    """The reward of one program: `total`, its named components (in [0, 1]) and weights, why it is what it is."""

    total: float
    components: dict[str, float]
    weights: dict[str, float]
    reason: str
    status: str  # the sandbox status (ok, failed, timeout, ...)
    tests_passed: int
    tests_total: int
    isolation: str

    def as_metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """Flat numbers to log (one per component, plus the total)."""
        return {prefix + "total": self.total, **{prefix + k: v for k, v in self.components.items()},
                prefix + "tests_passed": float(self.tests_passed)}


def harness_input(task: CodeTask, nonce: str) -> str:
    return f"{nonce}\n{task.name}\n{task.tests!r}\n"


def parse_report(result: SandboxResult, nonce: str) -> HarnessReport:
    """The harness's report from the program's stdout (the line that starts with the nonce)."""
    if result.status != "ok":
        return HarnessReport(error=f"{result.status}: {result.reason}")
    for line in result.stdout.splitlines():
        if line.startswith(nonce):
            report = json.loads(line[len(nonce):])
            if "error" in report:
                return HarnessReport(error=f"could not load the function: {report['error']}")
            rows = report["results"]
            return HarnessReport(passed=[bool(r[0]) for r in rows], seconds=[float(r[1]) for r in rows],
                              why=[str(r[2]) for r in rows])
    return HarnessReport(error="no test report (the program ended early or closed stdout)")


# ---------------------------------------------------------------------------------------------------------------
# The components: pure functions of the report, the program text and the task.


def pass_fraction(report: HarnessReport) -> float:
    return sum(report.passed) / len(report.passed) if report.passed else 0.0


def all_pass(report: HarnessReport) -> float:
    return 1.0 if report.passed and all(report.passed) else 0.0


def time_efficiency(report: HarnessReport, budget_ms: float) -> float:
    """1 - (test time / budget), clipped to [0, 1]; only for programs that pass everything."""
    if not all_pass(report):
        return 0.0
    return min(1.0, max(0.0, 1.0 - 1000.0 * sum(report.seconds) / budget_ms))


def lint_score(findings: int) -> float:
    return 1.0 / (1.0 + findings)


def _function(program: str, name: str) -> ast.FunctionDef | None:
    try:
        tree = ast.parse(program)
    except (SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    return None


def docstring_score(program: str, name: str) -> float:
    node = _function(program, name)
    return 1.0 if node is not None and ast.get_docstring(node) else 0.0


def cyclomatic_complexity(program: str, name: str) -> int | None:
    """McCabe complexity of the function `name` (radon), None if the program does not parse or lacks it."""
    from radon.complexity import cc_visit

    try:
        blocks = cc_visit(program)
    except (SyntaxError, ValueError):
        return None
    values = [b.complexity for b in blocks if b.name == name]
    return max(values) if values else None


def complexity_score(program: str, name: str, target: int) -> float:
    complexity = cyclomatic_complexity(program, name)
    return 0.0 if complexity is None else min(1.0, target / complexity)


def length_penalty(program: str, reference: str, ratio: float) -> float:
    """0 up to ratio x the reference's length, rising linearly to 1 at twice that."""
    budget = ratio * len(reference.strip())
    return min(1.0, max(0.0, len(program.strip()) / budget - 1.0))


def lint_findings(programs: list[str], select: list[str], ignore: list[str]) -> list[int]:
    """ruff findings per program, with one ruff run for all (ruff only parses; it never runs the code)."""
    if not programs:
        return []
    with tempfile.TemporaryDirectory(prefix="icrl-lint-") as tmp:
        paths = []
        for i, program in enumerate(programs):
            path = Path(tmp, f"p{i}.py")
            path.write_text(program, encoding="utf-8")
            paths.append(path)
        out = subprocess.run(
            [_ruff(), "check", "--isolated", "--no-cache", "--exit-zero", "--output-format", "json",
             "--select", ",".join(select), *(["--ignore", ",".join(ignore)] if ignore else []), *map(str, paths)],
            capture_output=True, text=True, check=True, cwd=tmp,
        )
        counts = {str(p): 0 for p in paths}
        for finding in json.loads(out.stdout or "[]"):
            counts[str(Path(finding["filename"]))] = counts.get(str(Path(finding["filename"])), 0) + 1
        return [counts[str(p)] for p in paths]


def _ruff() -> str:
    import shutil
    import sys

    # The ruff binary installed beside this interpreter (the venv), else the one on PATH.
    local = Path(sys.executable).with_name("ruff")
    found = str(local) if local.exists() else shutil.which("ruff")
    if not found:
        raise RuntimeError("ruff is not installed (pip install -c constraints.txt ruff)")
    return found


def compose(components: dict[str, float], penalty: float, gate: bool, config: CodeRewardConfig) -> float:
    """reward_scale * gate * max(0, sum_c w_c * c - w_length * penalty)."""
    if not gate:
        return 0.0
    weights = config.weights
    total = sum(getattr(weights, name) * value for name, value in components.items())
    return config.reward_scale * max(0.0, total - weights.length_penalty * penalty)


# ---------------------------------------------------------------------------------------------------------------


def score_many(programs: list[str], tasks: list[CodeTask], config: CodeConfig | None = None,
               reward_model_scores: list[float] | None = None) -> list[RewardBreakdown]:
    """Score each program against its task: the sandbox runs them in parallel (config.sandbox.workers), ruff
    lints them in one call."""
    config = config or CodeConfig()
    if len(programs) != len(tasks):
        raise ValueError(f"{len(programs)} programs for {len(tasks)} tasks")
    nonces = [secrets.token_hex(16) for _ in programs]
    results = run_programs([_HARNESS] * len(programs), config.sandbox,
                           stdins=[harness_input(t, n) for t, n in zip(tasks, nonces)],
                           files=[{"solution.py": p} for p in programs])
    findings = lint_findings(programs, config.reward.lint_select, config.reward.lint_ignore)
    breakdowns = []
    for i, (program, task, result) in enumerate(zip(programs, tasks, results)):
        report = parse_report(result, nonces[i])
        components = {
            "pass_fraction": pass_fraction(report),
            "all_pass": all_pass(report),
            "time_efficiency": time_efficiency(report, task.time_budget_ms),
            "lint": lint_score(findings[i]),
            "docstring": docstring_score(program, task.name),
            "complexity": complexity_score(program, task.name, config.reward.complexity_target),
            "reward_model": reward_model_scores[i] if reward_model_scores else 0.0,
        }
        penalty = length_penalty(program, task.reference, config.reward.length_ratio)
        gate = not report.error and any(report.passed)
        total = compose(components, penalty, gate, config.reward)
        if report.error:
            reason = report.error
        elif not any(report.passed):
            reason = "no test passed: " + "; ".join(sorted(set(report.why)))[:300]
        else:
            reason = f"{sum(report.passed)}/{len(report.passed)} tests passed"
        breakdowns.append(RewardBreakdown(
            total=total, components={**components, "length_penalty": penalty},
            weights=config.reward.weights.model_dump(), reason=reason, status=result.status,
            tests_passed=sum(report.passed), tests_total=len(task.tests), isolation=result.isolation))
    return breakdowns


def score(program: str, task: CodeTask, config: CodeConfig | None = None,
          reward_model_score: float | None = None) -> RewardBreakdown:
    """The reward of one program on one task (see the module docstring for the formula)."""
    scores = None if reward_model_score is None else [reward_model_score]
    return score_many([program], [task], config, scores)[0]


def extract_code(completion: str, task: CodeTask) -> str:
    """The program in a model's completion: the first ```python block (or the whole text), with the task's
    signature and docstring prepended when the completion holds only a function body."""
    text = completion
    if "```" in text:
        parts = text.split("```")
        block = parts[1] if len(parts) > 1 else text
        text = block.split("\n", 1)[1] if block.startswith(("python", "py\n", "\n")) else block
    if f"def {task.name}" not in text:
        text = task.prompt + text
    return text
