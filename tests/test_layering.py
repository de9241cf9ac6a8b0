"""icrl_core is a pure library: importing all of it pulls in no orchestration package."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_icrl_core_imports_no_orchestration_package():
    modules = sorted(p.stem for p in (ROOT / "icrl_core").glob("*.py") if p.stem != "__init__")
    code = (
        "import sys, importlib\n"
        f"for m in {modules!r}: importlib.import_module('icrl_core.' + m)\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & {'prefect', 'ray', 'mlflow', 'dvc'})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"icrl_core imported: {out.stdout}"
    for path in (ROOT / "icrl_core").rglob("*.py"):
        text = path.read_text()
        for pkg in ("prefect", "ray", "mlflow", "dvc"):
            assert f"import {pkg}" not in text and f"from {pkg}" not in text, (path, pkg)
