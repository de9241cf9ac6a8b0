"""Classification tasks: the paper's five datasets (read from a folder in the icrl-tasks format), their
`_unsemantic` variants, and synthetic tasks generated in code from a seed.

A task folder holds `train.jsonl` and `test.jsonl` (one {"text", "label"} per line, the dataset's own label
names), `labels.txt` and `label_map.tsv` (label -> the label text the paper's prompts use). Answers are always
written with the paper's label text. No dataset text lives in this repository.
"""

from __future__ import annotations

import csv
import io
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from icrl_core.errors import UserError
from icrl_core.io import read_user_text
from icrl_core.prompting import PromptTemplate, register_template, template_for

REAL_TASKS = ("banking77", "clinc150", "trec_coarse", "trec_fine", "nlu")
UNSEMANTIC = "_unsemantic"


@dataclass(frozen=True)
class Example:
    text: str
    label: str  # the label as written in prompts


@dataclass
class ClassificationTask:
    name: str
    labels: list[str]
    train: list[Example]
    test: list[Example]
    template: PromptTemplate

    def training_stream(self, size: int, seed: int) -> list[Example]:
        """`size` training examples in the paper's order: shuffle with `random.seed(seed)`, take the first."""
        return _shuffled_prefix(self.train, size, seed)

    def test_set(self, size: int, seed: int) -> list[Example]:
        return _shuffled_prefix(self.test, size, seed)


def _shuffled_prefix(rows: list[Example], size: int, seed: int) -> list[Example]:
    shuffled = list(rows)
    random.Random(seed).shuffle(shuffled)
    if size > len(shuffled):
        raise UserError(f"asked for {size} examples but the split has {len(shuffled)}")
    return shuffled[:size] if size >= 0 else shuffled


def _read_label_map(folder: Path) -> dict[str, str]:
    path = folder / "label_map.tsv"
    text = read_user_text(path, "label map", "each task folder needs label_map.tsv")
    rows = list(csv.DictReader(io.StringIO(text, newline=""), delimiter="\t"))
    if not rows or not {"label", "paper_label"} <= set(rows[0]):
        raise UserError(f"{path}: expected a TSV with columns label, paper_label, paper_id")
    rows.sort(key=lambda r: int(r.get("paper_id") or 0))
    return {r["label"]: r["paper_label"] for r in rows}


def _read_split(path: Path, label_map: dict[str, str]) -> list[Example]:
    examples = []
    for number, line in enumerate(read_user_text(path, "task split").split("\n"), start=1):  # JSONL: \n only
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            label = label_map[row["label"]]
            examples.append(Example(text=row["text"], label=label))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise UserError(f"{path}:{number}: bad row ({type(exc).__name__}: {exc})") from None
    return examples


def load_task_from_dir(name: str, tasks_dir: Path | str) -> ClassificationTask:
    """A real task (or its `_unsemantic` variant) from `tasks_dir/<name>/`."""
    base = name.removesuffix(UNSEMANTIC)
    folder = Path(tasks_dir) / base
    if not folder.is_dir():
        raise UserError(f"task '{base}' not found: {folder} does not exist (set data.tasks_dir to the folder "
                        "holding the task folders)")
    label_map = _read_label_map(folder)
    train = _read_split(folder / "train.jsonl", label_map)
    test = _read_split(folder / "test.jsonl", label_map)
    task = ClassificationTask(base, list(label_map.values()), train, test, template_for(base))
    return make_unsemantic(task) if name.endswith(UNSEMANTIC) else task


def make_unsemantic(task: ClassificationTask, seed: int = 0) -> ClassificationTask:
    """Replace every label by an opaque id ('L17'), assigned in a seeded random order, so label names carry no
    meaning and the mapping can only be learned from the data (the paper's abstract-label setting)."""
    order = list(range(len(task.labels)))
    random.Random(seed).shuffle(order)
    opaque = {label: f"L{order[i]:02d}" for i, label in enumerate(task.labels)}

    def relabel(rows: list[Example]) -> list[Example]:
        return [Example(e.text, opaque[e.label]) for e in rows]

    return ClassificationTask(task.name + UNSEMANTIC, [opaque[lb] for lb in task.labels], relabel(task.train),
                              relabel(task.test), task.template)


# ---------------------------------------------------------------------------------------------------------------
# Synthetic tasks: generated from a seed, hidden rules learnable only from rewards (labels carry no meaning).

_NOUNS = ["apple", "river", "candle", "tiger", "violin", "pepper", "castle", "rocket", "garden", "mirror",
          "anchor", "falcon", "marble", "saddle", "lantern", "walnut"]
_FILLERS = ["near the door", "after lunch", "in a box", "on the hill", "at night", "by the sea",
            "under the bridge", "before the storm", "with a friend", "in the market"]
_CODE_WORDS = ["zorp", "vell", "quix", "brom", "tasp", "nilk", "drax", "mumb"]


def keyword_map(seed: int = 0, n_train: int = 4000, n_test: int = 400, n_keywords: int = 12,
                n_labels: int = 4) -> ClassificationTask:
    """'Input: I saw a falcon at night.' -> a code word. A hidden random map sends each keyword to one of
    `n_labels` meaningless code words; other words are noise. Learnable in context by recalling which code
    word was rewarded for the same keyword."""
    rng = random.Random(seed)
    keywords = rng.sample(_NOUNS, n_keywords)
    labels = rng.sample(_CODE_WORDS, n_labels)
    mapping = {kw: labels[i % n_labels] for i, kw in enumerate(keywords)}

    def make(n: int) -> list[Example]:
        rows = []
        for _ in range(n):
            kw = rng.choice(keywords)
            rows.append(Example(f"I saw a {kw} {rng.choice(_FILLERS)}.", mapping[kw]))
        return rows

    return ClassificationTask("keyword_map", labels, make(n_train), make(n_test), template_for("keyword_map"))


def modular_sum(seed: int = 0, n_train: int = 4000, n_test: int = 400, modulus: int = 3) -> ClassificationTask:
    """'Numbers: 4 7 2' -> a code word for (sum mod `modulus`), code words assigned at random. A numeric rule
    the model must infer from rewards; much harder in context than keyword_map."""
    rng = random.Random(seed)
    labels = rng.sample(_CODE_WORDS, modulus)

    def make(n: int) -> list[Example]:
        rows = []
        for _ in range(n):
            numbers = [rng.randint(0, 9) for _ in range(rng.randint(2, 3))]
            rows.append(Example("Numbers: " + " ".join(map(str, numbers)), labels[sum(numbers) % modulus]))
        return rows

    return ClassificationTask("modular_sum", labels, make(n_train), make(n_test), template_for("modular_sum"))


register_template("keyword_map", PromptTemplate(query_prefix="Input:", answer_prefix="Label:",
                                                task_description="Each input has one hidden label."))
register_template("modular_sum", PromptTemplate(query_prefix="Input:", answer_prefix="Label:",
                                                task_description="Each input has one hidden label."))

SYNTHETIC_TASKS: dict[str, Callable[..., ClassificationTask]] = {
    "keyword_map": keyword_map,
    "modular_sum": modular_sum,
}


def available_tasks() -> list[str]:
    return list(REAL_TASKS) + [t + UNSEMANTIC for t in REAL_TASKS] + list(SYNTHETIC_TASKS)


def load_task(name: str, tasks_dir: Path | str, seed: int = 0) -> ClassificationTask:
    """Any task by name: synthetic ones are generated from `seed`, real ones read from `tasks_dir`."""
    if name in SYNTHETIC_TASKS:
        return SYNTHETIC_TASKS[name](seed=seed)
    if name.removesuffix(UNSEMANTIC) in REAL_TASKS:
        return load_task_from_dir(name, tasks_dir)
    raise UserError(f"unknown task '{name}'; available: {', '.join(available_tasks())}")


# ---------------------------------------------------------------------------------------------------------------
# The Hugging Face Hub path: the datasets the paper loads (ids from each task folder's SOURCE.md), converted to the
# same Examples. `load_task_from_hub` needs network access or the local HF cache; `load_task_from_disk` reads a
# DatasetDict saved with `save_to_disk` (how tests and offline users exercise the same conversion).


@dataclass(frozen=True)
class HubSpec:
    """Where a task lives on the Hub and how its rows become (text, label name)."""

    dataset_id: str
    config: str | None
    label_column: str
    text_column: str = "text"
    drop_labels: tuple[str, ...] = ()
    test_fraction: float | None = None  # split train/test ourselves (the paper's train_test_split(seed=0))


HUB_SPECS: dict[str, HubSpec] = {
    "banking77": HubSpec("PolyAI/banking77", None, "label"),
    "clinc150": HubSpec("clinc/clinc_oos", "plus", "intent", drop_labels=("oos",)),
    "trec_coarse": HubSpec("CogComp/trec", None, "coarse_label"),
    "trec_fine": HubSpec("CogComp/trec", None, "fine_label"),
    "nlu": HubSpec("xingkunliuxtracta/nlu_evaluation_data", None, "label", test_fraction=0.2),
}


def paper_label_text(label: str) -> str:
    """The paper's label text when no label_map.tsv is at hand: 'Refund_not_showing_up' -> 'refund not showing
    up'. (label_map.tsv, when present, is authoritative: TREC's 'DESC:manner' needs it.)"""
    return label.replace("_", " ").rstrip("?").strip().lower()


def task_from_dataset_dict(name: str, dataset, label_map: dict[str, str] | None = None) -> ClassificationTask:
    """A task from a `datasets.DatasetDict` shaped like the Hub dataset of `name` (or its `_unsemantic`
    variant): label ids become the dataset's label names (ClassLabel), then the paper's label text."""
    base = name.removesuffix(UNSEMANTIC)
    if base not in HUB_SPECS:
        raise UserError(f"task '{base}' has no Hub source; Hub tasks: {', '.join(HUB_SPECS)}")
    spec = HUB_SPECS[base]
    if spec.test_fraction is not None and "test" not in dataset:
        dataset = dataset["train"].train_test_split(test_size=spec.test_fraction, seed=0)
    for split in ("train", "test"):
        if split not in dataset:
            raise UserError(f"the dataset of '{base}' has no '{split}' split (found: {', '.join(dataset)})")
        missing = {spec.text_column, spec.label_column} - set(dataset[split].column_names)
        if missing:
            raise UserError(f"the '{split}' split of '{base}' lacks column(s) {sorted(missing)}")
    feature = dataset["train"].features[spec.label_column]
    names = list(getattr(feature, "names", None) or [])

    def name_of(value) -> str:
        return names[value] if names and isinstance(value, int) else str(value)

    def text_of(label: str) -> str:
        return label_map[label] if label_map and label in label_map else paper_label_text(label)

    def rows(split: str) -> list[Example]:
        data = dataset[split]
        out = []
        for text, value in zip(data[spec.text_column], data[spec.label_column]):
            label = name_of(value)
            if label not in spec.drop_labels:
                out.append(Example(text=text, label=text_of(label)))
        return out

    train, test = rows("train"), rows("test")
    if names:  # every label of the dataset, in its id order (or label_map's paper order when given)
        labels = [text_of(n) for n in names if n not in spec.drop_labels]
        if label_map:
            order = {text: i for i, text in enumerate(label_map.values())}
            labels.sort(key=lambda t: order.get(t, len(order)))
    else:
        labels = [t for lb, t in (label_map or {}).items() if lb not in spec.drop_labels]
        labels += sorted({e.label for e in train + test} - set(labels))
    task = ClassificationTask(base, labels, train, test, template_for(base))
    return make_unsemantic(task) if name.endswith(UNSEMANTIC) else task


def _optional_label_map(name: str, tasks_dir: Path | str | None) -> dict[str, str] | None:
    if tasks_dir is None:
        return None
    path = Path(tasks_dir) / name.removesuffix(UNSEMANTIC) / "label_map.tsv"
    return _read_label_map(path.parent) if path.exists() else None


def load_task_from_hub(name: str, tasks_dir: Path | str | None = None) -> ClassificationTask:
    """A real task from the Hugging Face Hub (the id in its SOURCE.md), via `datasets.load_dataset`. Offline
    (HF_DATASETS_OFFLINE=1, the default here) only the local HF cache is used. Label text comes from
    `tasks_dir/<task>/label_map.tsv` when it exists."""
    base = name.removesuffix(UNSEMANTIC)
    if base not in HUB_SPECS:
        raise UserError(f"task '{base}' has no Hub source; Hub tasks: {', '.join(HUB_SPECS)}")
    import datasets

    spec = HUB_SPECS[base]
    try:
        dataset = datasets.load_dataset(spec.dataset_id, spec.config)
    except Exception as exc:  # offline, not cached, or the Hub refused
        raise UserError(f"cannot load '{spec.dataset_id}' from the Hugging Face Hub ({type(exc).__name__}: "
                        f"{str(exc)[:200]}); use source=dir with data.tasks_dir, or source=disk") from None
    return task_from_dataset_dict(name, dataset, _optional_label_map(name, tasks_dir))


def load_task_from_disk(name: str, path: Path | str, tasks_dir: Path | str | None = None) -> ClassificationTask:
    """A real task from a DatasetDict saved with `save_to_disk` (same columns as the Hub dataset)."""
    import datasets

    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no saved dataset here (expected a folder written by DatasetDict.save_to_disk)")
    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise UserError(f"{path}: not a saved dataset ({type(exc).__name__}: {str(exc)[:200]})") from None
    if isinstance(dataset, datasets.Dataset):
        dataset = datasets.DatasetDict({"train": dataset})
    return task_from_dataset_dict(name, dataset, _optional_label_map(name, tasks_dir))


def load_task_from_source(name: str, source: str, tasks_dir: Path | str, seed: int = 0,
                          disk_path: Path | str | None = None) -> ClassificationTask:
    """`load_task` with a choice of where real tasks come from: 'dir' (tasks_dir), 'hub' or 'disk'."""
    if name in SYNTHETIC_TASKS or source == "dir":
        return load_task(name, tasks_dir, seed=seed)
    if source == "hub":
        return load_task_from_hub(name, tasks_dir)
    if source == "disk":
        if disk_path is None:
            raise UserError("source=disk needs a disk_path (a folder written by DatasetDict.save_to_disk)")
        return load_task_from_disk(name, disk_path, tasks_dir)
    raise UserError(f"unknown task source '{source}' (dir, hub, disk)")
