"""The code-task family: small Python function tasks generated from seeded templates.

Each template (string, list, arithmetic or dict manipulation; difficulty level 1-3) makes `variants` tasks from a
seeded random generator: a signature and docstring (what the model sees), hidden test cases (arguments and
expected result) and a reference solution. Expected results are computed by running the reference here, at
generation time (trusted code); candidates only ever run in the sandbox (icrl_core/code_reward.py).

The train/test split is by template: every task of a test template is unseen in training, not just its
parameters. `code_tasks(seed)` is deterministic.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal

Family = Literal["string", "list", "arithmetic", "dict"]

# Templates whose tasks form the test split (two per level, mixed families).
TEST_TEMPLATES = frozenset({"multiply_by", "ends_with_suffix", "count_above", "swap_case_every", "run_length",
                            "merge_sum"})
N_TESTS = 6


@dataclass(frozen=True)
class CodeTask:
    """One function to write: `prompt` (signature + docstring) is what the model sees; `tests` are hidden."""

    task_id: str
    template: str
    family: Family
    level: int
    split: Literal["train", "test"]
    name: str
    signature: str
    docstring: str
    tests: tuple[tuple[tuple, Any], ...]
    reference: str  # a correct solution (signature + docstring + body)
    time_budget_ms: float = 50.0  # all tests together; the time-efficiency bonus is 0 at this

    @property
    def prompt(self) -> str:
        return f'{self.signature}\n    """{self.docstring}"""\n'


@dataclass(frozen=True)
class _Variant:
    name: str
    args: str  # "x: int, k: int"
    returns: str
    doc: str
    body: str  # indented body of the reference
    inputs: Callable[[random.Random], tuple]


@dataclass(frozen=True)
class _Template:
    name: str
    family: Family
    level: int
    make: Callable[[random.Random], _Variant]


_TEMPLATES: list[_Template] = []


def _template(family: Family, level: int):
    def register(make: Callable[[random.Random], _Variant]) -> Callable[[random.Random], _Variant]:
        _TEMPLATES.append(_Template(make.__name__, family, level, make))
        return make
    return register


def _word(rng: random.Random, low: int = 1, high: int = 8, letters: str = string.ascii_lowercase) -> str:
    return "".join(rng.choice(letters) for _ in range(rng.randint(low, high)))


def _ints(rng: random.Random, low: int = -20, high: int = 20, min_len: int = 0, max_len: int = 8) -> list[int]:
    """Random integers; most lists repeat some values, so a solution that drops duplicates fails a test."""
    values = [rng.randint(low, high) for _ in range(rng.randint(min_len, max_len))]
    if values and rng.random() < 0.8:
        values[rng.randrange(len(values))] = rng.choice(values)
        values.insert(rng.randrange(len(values) + 1), rng.choice(values))
    return values


def _small_dict(rng: random.Random, size: int = 5) -> dict[str, int]:
    return {_word(rng, 1, 4): rng.randint(-9, 9) for _ in range(rng.randint(0, size))}


# ---------------------------------------------------------------------------------------------------------------
# Level 1: one expression.


@_template("arithmetic", 1)
def add_constant(rng):
    k = rng.randint(2, 99)
    return _Variant(f"add_{k}", "x: int", "int", f"Return x plus {k}.", f"return x + {k}",
                    lambda r: (r.randint(-1000, 1000),))


@_template("arithmetic", 1)
def multiply_by(rng):
    k = rng.randint(2, 12)
    return _Variant(f"times_{k}", "x: int", "int", f"Return x multiplied by {k}.", f"return x * {k}",
                    lambda r: (r.randint(-500, 500),))


@_template("arithmetic", 1)
def is_multiple(rng):
    k = rng.randint(2, 20)
    return _Variant(f"is_multiple_of_{k}", "n: int", "bool", f"Return True if n is divisible by {k}, else False.",
                    f"return n % {k} == 0", lambda r: (r.randint(-100, 100) * r.choice([1, k]),))


@_template("string", 1)
def repeat_string(rng):
    k = rng.randint(2, 5)
    sep, sep_name = rng.choice([("", ""), (" ", "_spaced"), ("-", "_dashed"), (",", "_commas")])
    return _Variant(f"repeat_{k}_times{sep_name}", "s: str", "str",
                    f"Return the string s repeated {k} times" + (f", separated by '{sep}'." if sep else "."),
                    f"return {sep!r}.join([s] * {k})", lambda r: (_word(r, 0, 5),))


@_template("string", 1)
def ends_with_suffix(rng):
    suffix = _word(rng, 1, 3)
    return _Variant(f"ends_with_{suffix}", "s: str", "bool", f"Return True if s ends with '{suffix}'.",
                    f"return s.endswith({suffix!r})",
                    lambda r: (_word(r, 0, 5) + r.choice(["", suffix, suffix[::-1]]),))


@_template("string", 1)
def add_prefix(rng):
    prefix = _word(rng, 1, 4)
    return _Variant(f"add_prefix_{prefix}", "s: str", "str", f"Return s with '{prefix}' added at the front.",
                    f"return {prefix!r} + s", lambda r: (_word(r, 0, 6),))


@_template("list", 1)
def list_sum_plus(rng):
    k = rng.randint(1, 50)
    return _Variant(f"sum_plus_{k}", "xs: list[int]", "int", f"Return the sum of the numbers in xs plus {k}.",
                    f"return sum(xs) + {k}", lambda r: (_ints(r),))


@_template("list", 1)
def list_max_or(rng):
    default = rng.randint(-5, 5)
    return _Variant(f"largest_or_{default}".replace("-", "minus_"), "xs: list[int]", "int",
                    f"Return the largest number in xs, or {default} if xs is empty.",
                    f"return max(xs) if xs else {default}", lambda r: (_ints(r),))


@_template("dict", 1)
def dict_get_default(rng):
    default = rng.randint(-9, 9)
    return _Variant(f"lookup_or_{default}".replace("-", "minus_"), "d: dict[str, int], key: str", "int",
                    f"Return d[key] if key is in d, else {default}.", f"return d.get(key, {default})",
                    lambda r: ((d := _small_dict(r)), r.choice(list(d) + ["zz"]) if d else "zz"))


@_template("dict", 1)
def dict_count_keys(rng):
    k = rng.randint(1, 20)
    return _Variant(f"size_plus_{k}", "d: dict[str, int]", "int",
                    f"Return the number of keys in d plus {k}.", f"return len(d) + {k}",
                    lambda r: (_small_dict(r),))


# ---------------------------------------------------------------------------------------------------------------
# Level 2: a loop or a condition.


@_template("list", 2)
def count_above(rng):
    t = rng.randint(-5, 10)
    return _Variant(f"count_above_{t}".replace("-", "minus_"), "xs: list[int]", "int",
                    f"Return how many numbers in xs are strictly greater than {t}.",
                    f"return sum(1 for x in xs if x > {t})", lambda r: (_ints(r),))


@_template("list", 2)
def filter_multiples(rng):
    k = rng.randint(2, 12)
    return _Variant(f"keep_multiples_of_{k}", "xs: list[int]", "list[int]",
                    f"Return the numbers of xs that are divisible by {k}, in their original order.",
                    f"return [x for x in xs if x % {k} == 0]", lambda r: (_ints(r),))


@_template("list", 2)
def clamp_all(rng):
    low = rng.randint(-10, 0)
    high = rng.randint(1, 10)
    return _Variant(f"clamp_{-low}_{high}", "xs: list[int]", "list[int]",
                    f"Return a new list where every number of xs is limited to the range [{low}, {high}].",
                    f"return [min(max(x, {low}), {high}) for x in xs]", lambda r: (_ints(r),))


@_template("string", 2)
def count_char(rng):
    c = rng.choice("abcdeilmnorstu")
    return _Variant(f"count_{c}", "s: str", "int", f"Return how many times the letter '{c}' occurs in s, "
                    "ignoring case.", f"return s.lower().count({c!r})",
                    lambda r: (_word(r, 0, 12, string.ascii_letters),))


@_template("string", 2)
def swap_case_every(rng):
    k = rng.randint(2, 5)
    rest = rng.randint(0, k - 1)
    return _Variant(f"upper_every_{k}_from_{rest}", "s: str", "str",
                    f"Return s with every character whose index i has i % {k} == {rest} in upper case and the rest "
                    "unchanged.", f"return ''.join(c.upper() if i % {k} == {rest} else c for i, c in enumerate(s))",
                    lambda r: (_word(r, 0, 10),))


@_template("string", 2)
def join_words(rng):
    names = {"-": "dash", "_": "underscore", ", ": "comma", " | ": "bar", "+": "plus", " ": "space", "/": "slash",
             ";": "semicolon", ":": "colon", ".": "dot", "=": "equals", "#": "hash"}
    sep = rng.choice(sorted(names))
    return _Variant("join_with_" + names[sep],
                    "words: list[str]", "str", f"Return the words joined by '{sep}'.", f"return {sep!r}.join(words)",
                    lambda r: ([_word(r) for _ in range(r.randint(0, 4))],))


@_template("arithmetic", 2)
def fizz_word(rng):
    a, b = rng.sample([2, 3, 5, 7], 2)
    return _Variant(f"fizz_{a}_{b}", "n: int", "str",
                    f"Return 'Fizz' if n is divisible by {a}, 'Buzz' if by {b}, 'FizzBuzz' if by both, else "
                    "str(n).",
                    f"if n % {a * b} == 0:\n        return 'FizzBuzz'\n    if n % {a} == 0:\n        return 'Fizz'\n"
                    f"    if n % {b} == 0:\n        return 'Buzz'\n    return str(n)",
                    lambda r: (r.randint(1, 60),))


@_template("arithmetic", 2)
def sum_of_digits(rng):
    k = rng.randint(0, 20)
    return _Variant(f"digit_sum_plus_{k}", "n: int", "int",
                    f"Return the sum of the decimal digits of abs(n), plus {k}.",
                    f"return sum(int(d) for d in str(abs(n))) + {k}", lambda r: (r.randint(-99999, 99999),))


@_template("dict", 2)
def invert_dict(rng):
    k = rng.randint(0, 12)
    return _Variant(f"invert_shift_{k}", "d: dict[str, int]", "dict[int, str]",
                    f"Return a dict mapping each value of d plus {k} to its key (values of d are distinct).",
                    f"return {{v + {k}: key for key, v in d.items()}}",
                    lambda r: ({_word(r, 1, 3) + str(i): i * r.randint(1, 3) for i in range(r.randint(0, 5))},))


@_template("dict", 2)
def word_lengths(rng):
    k = rng.randint(1, 12)
    return _Variant(f"lengths_at_least_{k}", "words: list[str]", "dict[str, int]",
                    f"Return a dict mapping each word of at least {k} letters to its length.",
                    f"return {{w: len(w) for w in words if len(w) >= {k}}}",
                    lambda r: ([_word(r, 1, 14) for _ in range(r.randint(0, 6))],))


# ---------------------------------------------------------------------------------------------------------------
# Level 3: a little algorithm.


@_template("string", 3)
def run_length(rng):
    names = {"": "", ":": "_colon", "x": "_x", "-": "_dash", "*": "_star", "/": "_slash"}
    sep = rng.choice(sorted(names))
    count_first = rng.random() < 0.5
    run = "str(j - i) + {sep!r} + s[i]" if count_first else "s[i] + {sep!r} + str(j - i)"
    example = f"'2{sep}a1{sep}b'" if count_first else f"'a{sep}2b{sep}1'"
    return _Variant("run_length" + ("_count_first" if count_first else "") + names[sep], "s: str", "str",
                    "Run-length encode s: each run of equal characters becomes "
                    + ("the run length, '{sep}' and the character" if count_first
                       else "the character, '{sep}' and the run length").format(sep=sep)
                    + f" (e.g. 'aab' -> {example}).",
                    "out = []\n    i = 0\n    while i < len(s):\n        j = i\n"
                    "        while j < len(s) and s[j] == s[i]:\n"
                    f"            j += 1\n        out.append({run.format(sep=sep)})\n        i = j\n"
                    "    return ''.join(out)",
                    lambda r: ("".join(r.choice("ab") * r.randint(1, 3) for _ in range(r.randint(0, 4))),))


@_template("string", 3)
def caesar_shift(rng):
    k = rng.randint(1, 25)
    return _Variant(f"caesar_{k}", "s: str", "str",
                    f"Shift every lowercase letter of s forward by {k} places in the alphabet (wrapping from 'z' "
                    "to 'a'); other characters stay unchanged.",
                    f"return ''.join(chr((ord(c) - 97 + {k}) % 26 + 97) if 'a' <= c <= 'z' else c for c in s)",
                    lambda r: (_word(r, 0, 10, string.ascii_lowercase + " !"),))


@_template("string", 3)
def palindrome_clean(rng):
    keep = rng.choice(["letters", "letters and digits"])
    m = rng.randint(0, 5)
    test = "c.isalpha()" if keep == "letters" else "c.isalnum()"
    return _Variant(f"is_clean_palindrome{'' if keep == 'letters' else '_alnum'}_min_{m}", "s: str", "bool",
                    f"Return True if s reads the same backwards, considering only {keep} and ignoring case, and "
                    f"has at least {m} such characters.",
                    f"t = [c.lower() for c in s if {test}]\n    return t == t[::-1] and len(t) >= {m}",
                    lambda r: ((w := _word(r, 0, 4)) + r.choice(["", " ", "1", "!"]) + r.choice([w[::-1], w]).upper(),))


@_template("list", 3)
def second_largest(rng):
    default = rng.randint(-9, 9)
    return _Variant(f"second_largest_or_{default}".replace("-", "minus_"), "xs: list[int]", "int",
                    f"Return the second largest distinct number in xs, or {default} if there is none.",
                    f"d = sorted(set(xs))\n    return d[-2] if len(d) >= 2 else {default}",
                    lambda r: (_ints(r, -5, 5),))


@_template("list", 3)
def rotate_list(rng):
    k = rng.randint(1, 6)
    left = rng.random() < 0.5
    moved = f"the first {k} elements move to the end" if left else f"the last {k} elements move to the front"
    return _Variant(f"rotate_{'left' if left else 'right'}_{k}", "xs: list[int]", "list[int]",
                    f"Return xs rotated {'left' if left else 'right'} by {k} positions ({moved}, wrapping around "
                    "for short lists); an empty list stays empty.",
                    f"if not xs:\n        return []\n    k = {k if left else -k} % len(xs)\n    return xs[k:] + xs[:k]",
                    lambda r: (_ints(r),))


@_template("list", 3)
def running_max(rng):
    start = rng.randint(-10, 0)
    return _Variant(f"running_max_from_{-start}", "xs: list[int]", "list[int]",
                    f"Return the running maximum of xs: element i is the largest of {start} and xs[0..i].",
                    f"out = []\n    m = {start}\n    for x in xs:\n        m = max(m, x)\n        out.append(m)\n"
                    "    return out", lambda r: (_ints(r),))


@_template("dict", 3)
def merge_sum(rng):
    k = rng.randint(1, 12)
    return _Variant(f"merge_add_{k}x", "a: dict[str, int], b: dict[str, int]", "dict[str, int]",
                    f"Return a dict with the keys of both a and b; a key's value is a's value plus {k} times b's "
                    "value (a missing value counts as 0).",
                    f"return {{key: a.get(key, 0) + {k} * b.get(key, 0) for key in set(a) | set(b)}}",
                    lambda r: (_small_dict(r), _small_dict(r)))


@_template("dict", 3)
def group_by_length(rng):
    k = rng.randint(0, 11)
    return _Variant(f"group_by_length_plus_{k}", "words: list[str]", "dict[int, list[str]]",
                    f"Group the words by their length plus {k}: return a dict mapping length + {k} to the list of "
                    "words with that length, in their original order.",
                    f"out = {{}}\n    for w in words:\n        out.setdefault(len(w) + {k}, []).append(w)\n"
                    "    return out", lambda r: ([_word(r, 1, 4) for _ in range(r.randint(0, 6))],))


@_template("dict", 3)
def most_common_char(rng):
    tie = rng.choice(["first", "smallest"])
    skip = rng.choice("abcdef")
    return _Variant(f"most_common_char_except_{skip}" + ("" if tie == "first" else "_smallest"), "s: str", "str",
                    f"Return the character other than '{skip}' that occurs most often in s (s always has one); on "
                    "a tie, the one "
                    + ("that occurs first in s." if tie == "first" else "that is alphabetically smallest."),
                    f"counts = {{}}\n    for c in s:\n        if c != {skip!r}:\n"
                    "            counts[c] = counts.get(c, 0) + 1\n"
                    + ("    return max(counts, key=lambda c: (counts[c], -s.index(c)))" if tie == "first"
                       else "    return min(counts, key=lambda c: (-counts[c], c))"),
                    lambda r: (_word(r, 0, 8, "abcdef") + r.choice("abcdef".replace(skip, "")),))


@_template("arithmetic", 3)
def digital_root(rng):
    base = rng.randint(2, 16)
    return _Variant(f"digital_root_base_{base}", "n: int", "int",
                    f"Repeatedly replace n (n >= 0) by the sum of its base-{base} digits until it is below {base}; "
                    "return the result.",
                    f"while n >= {base}:\n        total = 0\n        while n:\n            total += n % {base}\n"
                    f"            n //= {base}\n        n = total\n    return n",
                    lambda r: (r.randint(0, 10 ** 6),))


@_template("arithmetic", 3)
def count_primes_below(rng):
    k = rng.randint(0, 12)
    return _Variant(f"primes_below_plus_{k}", "n: int", "int",
                    f"Return the number of primes strictly less than n, plus {k}.",
                    "count = 0\n    for m in range(2, n):\n"
                    "        if all(m % d for d in range(2, int(m ** 0.5) + 1)):\n"
                    f"            count += 1\n    return count + {k}", lambda r: (r.randint(0, 60),))


# ---------------------------------------------------------------------------------------------------------------


def _make_task(template: _Template, index: int, variant: _Variant, rng: random.Random) -> CodeTask:
    signature = f"def {variant.name}({variant.args}) -> {variant.returns}:"
    reference = f'{signature}\n    """{variant.doc}"""\n    {variant.body}\n'
    namespace: dict[str, Any] = {}
    exec(compile(reference, f"<reference {template.name}>", "exec"), namespace)  # noqa: S102 - our own template
    function = namespace[variant.name]
    tests = []
    seen = set()
    for _ in range(N_TESTS * 4):
        args = variant.inputs(rng)
        if repr(args) in seen:
            continue
        seen.add(repr(args))
        tests.append((args, function(*args)))
        if len(tests) == N_TESTS:
            break
    return CodeTask(task_id=f"{template.name}/{index:02d}", template=template.name, family=template.family,
                    level=template.level, split="test" if template.name in TEST_TEMPLATES else "train",
                    name=variant.name, signature=signature, docstring=variant.doc, tests=tuple(tests),
                    reference=reference)


@cache
def code_tasks(seed: int = 0, variants: int = 11) -> tuple[CodeTask, ...]:
    """Every task of the family: `variants` per template, generated from `seed` (same seed, same tasks)."""
    tasks = []
    for template in _TEMPLATES:
        rng = random.Random(f"{seed}/{template.name}")
        names: set[str] = set()
        for _ in range(variants * 10):  # distinct variants only; a template with few parameters makes fewer
            variant = template.make(rng)
            if variant.name not in names:
                names.add(variant.name)
                tasks.append(_make_task(template, len(names) - 1, variant, rng))
            if len(names) == variants:
                break
    return tuple(tasks)


def split_tasks(split: Literal["train", "test"], seed: int = 0, variants: int = 11) -> list[CodeTask]:
    return [t for t in code_tasks(seed, variants) if t.split == split]


def template_names() -> list[str]:
    return [t.name for t in _TEMPLATES]


@dataclass(frozen=True)
class FamilySummary:
    templates: int
    tasks: int
    by_split: dict[str, int] = field(default_factory=dict)
    by_level: dict[int, int] = field(default_factory=dict)


def summary(seed: int = 0, variants: int = 11) -> FamilySummary:
    tasks = code_tasks(seed, variants)
    by_split: dict[str, int] = {}
    by_level: dict[int, int] = {}
    for task in tasks:
        by_split[task.split] = by_split.get(task.split, 0) + 1
        by_level[task.level] = by_level.get(task.level, 0) + 1
    return FamilySummary(len(_TEMPLATES), len(tasks), by_split, dict(sorted(by_level.items())))
