"""The examples of issue 31 through the real `icrl` console script (and in-process): one message, exit code 2,
no traceback. The walk over every command and option: tests/unit/test_cli_errors.py."""

from __future__ import annotations

from tests.conftest import run_cli
from tests.unit.test_cli_errors import NOT_UTF8, call


def test_the_issues_examples(tmp_path, monkeypatch):
    """The examples of issue 31: the message on stderr, exit code 2, no traceback; three of them through the real
    console script (a fresh interpreter, as a user runs it), the others in-process."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "latin1.yaml").write_bytes(NOT_UTF8)
    in_shell = {
        ("eval", "--strategy", "bogus"): "'bogus' is not one of",  # an error of typer's own click
        ("stage", "nosuchstage"): "unknown stage 'nosuchstage'",
        ("config", "show", "-c", str(tmp_path / "latin1.yaml")): "not UTF-8",
    }
    in_process = {
        ("eval", "--train-k", "-5"): "Invalid value for '--train-k'",
        ("eval", "--adapter", "x"): "Invalid value for '--adapter'",
        ("validate-episodes", str(tmp_path)): "is a directory",
        ("eval", "-c", str(tmp_path / "latin1.yaml")): "not UTF-8",
    }
    for argv, message in in_shell.items():
        result = run_cli(*argv, cwd=tmp_path)
        assert result.returncode == 2 and message in result.stderr, (argv, result.stderr)
        assert "Traceback" not in result.stderr, result.stderr
    for argv, message in in_process.items():
        code, err = call(list(argv))
        assert code == 2 and message in err and "Traceback" not in err, (argv, err)
