"""Find a dataset's text where it must not be (a folder about to be committed, a parked run, the repository).

The datasets' queries may be read, never copied into the repository (docs/TASKS.md). `TextFinder` looks for many
texts at once in one pass over a string: every text of at least `MIN_CHARS` characters is indexed by its
`WINDOW`-character slices at offsets 0..STRIDE-1, and the string is probed every `STRIDE` characters. An occurrence
of a text starting at position s covers a probe position s + d with 0 <= d < STRIDE, where the string's window is
the text's slice at offset d, so no occurrence is missed; a window hit is confirmed by comparing the whole text.
A text is also looked for as it appears inside a JSON string (quotes and backslashes escaped, non-ASCII as \\uXXXX).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

MIN_CHARS = 16  # shorter texts (labels, one-word queries) are too common to mean a copied query
WINDOW = 12
STRIDE = MIN_CHARS - WINDOW + 1  # = 5: every indexed form has a slice at each offset 0..STRIDE-1


@dataclass(frozen=True)
class TextHit:
    position: int  # character offset of the occurrence in the searched string
    text: str  # the dataset text found (as given to TextFinder, not its JSON form)


class TextFinder:
    """An index of texts (stripped, >= MIN_CHARS characters) for `find`."""

    def __init__(self, texts: Iterable[str]):
        self.windows: dict[str, list[tuple[str, int, str]]] = {}  # slice -> (form, offset in form, text)
        self.count = 0
        for text in {t.strip() for t in texts}:
            if len(text) < MIN_CHARS:
                continue
            self.count += 1
            for form in {text, json.dumps(text)[1:-1], json.dumps(text, ensure_ascii=False)[1:-1]}:
                for offset in range(STRIDE):
                    self.windows.setdefault(form[offset:offset + WINDOW], []).append((form, offset, text))

    def find(self, data: str) -> TextHit | None:
        """The first occurrence (in probe order) of any indexed text in `data`, or None."""
        for probe in range(0, len(data) - WINDOW + 1, STRIDE):
            for form, offset, text in self.windows.get(data[probe:probe + WINDOW], ()):
                start = probe - offset
                if start >= 0 and data.startswith(form, start):
                    return TextHit(start, text)
        return None
