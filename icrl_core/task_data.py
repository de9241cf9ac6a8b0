"""Classification tasks: the paper's five datasets and any user's task folder (read from a folder in the
icrl-tasks format), their `_unsemantic` variants, and synthetic tasks generated in code from a seed.

A task folder holds `train.jsonl` and `test.jsonl` (one {"text", "label"} per line, the dataset's own label
names) and `labels.txt` (one label per line, every label the splits use). Optional: `label_map.tsv` (label -> the
label text prompts use, e.g. the paper's; without it labels are written as they are) and `prompt.yaml` (the task's
prompt prefixes: query_prefix, answer_prefix, task_description; data.task_prompts overrides them). A task is named
by a built-in name, a folder name under data.tasks_dir, or a path to a folder (docs/TASKS.md). No dataset text
lives in this repository.
"""

from __future__ import annotations

import csv
import io
import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from icrl_core.errors import UserError
from icrl_core.io import read_user_text
from icrl_core.prompting import PromptTemplate, register_template, template_for

REAL_TASKS = ("banking77", "clinc150", "trec_coarse", "trec_fine", "nlu")
UNSEMANTIC = "_unsemantic"
TASK_FILES = ("train.jsonl", "test.jsonl", "labels.txt")  # what makes a folder a task
PROMPT_FILE = "prompt.yaml"
PROMPT_KEYS = ("query_prefix", "answer_prefix", "task_description")  # what a task's prompt may set


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


def _read_labels(folder: Path) -> list[str]:
    path = folder / "labels.txt"
    labels = [line.strip() for line in read_user_text(path, "label list", "one label per line").splitlines()]
    labels = [label for label in labels if label]
    if len(labels) < 2:
        raise UserError(f"{path}: a task needs at least 2 labels, one per line (found {len(labels)})")
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise UserError(f"{path}: label(s) listed twice: {', '.join(repeated)}")
    return labels


def _read_split(path: Path, label_map: dict[str, str]) -> list[Example]:
    """One split: every row a JSON object with a non-empty "text" and a "label" among `label_map`'s keys."""
    examples = []
    for number, line in enumerate(read_user_text(path, "task split").split("\n"), start=1):  # JSONL: \n only
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{number}: not a JSON line ({exc})") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str) or not row["text"].strip():
            raise UserError(f"{path}:{number}: expected an object with a non-empty \"text\" and a \"label\"")
        label = row.get("label")
        if not isinstance(label, str) or label not in label_map:
            raise UserError(f"{path}:{number}: label {json.dumps(label)} is not in labels.txt")
        examples.append(Example(text=row["text"], label=label_map[label]))
    if not examples:
        raise UserError(f"{path}: no examples")
    return examples


def _read_prompt(folder: Path) -> dict[str, str]:
    """The task's prompt prefixes from its optional prompt.yaml."""
    import yaml

    path = folder / PROMPT_FILE
    if not path.exists():
        return {}
    try:
        fields = yaml.safe_load(read_user_text(path, "prompt file")) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(fields, dict) or not set(fields) <= set(PROMPT_KEYS) or not all(
            isinstance(v, str) for v in fields.values()):
        raise UserError(f"{path}: expected text values for some of {', '.join(PROMPT_KEYS)}")
    return fields


def is_task_path(name: str) -> bool:
    """A task given as a path (./mine, /data/mine, ~/mine) rather than by name."""
    return os.sep in name or name.startswith((".", "~"))


def task_label(name: str) -> str:
    """The name a task is known by (run names, episodes' task_type): a path's folder name, else the name."""
    return Path(name).expanduser().resolve().name if is_task_path(name) else name  # resolved: `.` has a name


def task_folder(name: str, tasks_dir: Path | str | None) -> Path | None:
    """The folder of a task read from disk: `name` itself when it is a path, else tasks_dir/<name without
    _unsemantic> when that folder exists; None for synthetic tasks and names with no folder."""
    if name in SYNTHETIC_TASKS:
        return None
    if is_task_path(name):
        return Path(name).expanduser()
    if tasks_dir is not None and (Path(tasks_dir) / name.removesuffix(UNSEMANTIC)).is_dir():
        return Path(tasks_dir) / name.removesuffix(UNSEMANTIC)
    return None


def task_template(name: str, folder: Path | None, prompt: dict[str, str | None] | None = None) -> PromptTemplate:
    """The prompt template of a task: the built-in one of its name (or the generic one), then the folder's
    prompt.yaml, then `prompt` (data.task_prompts); registered under the task's name so episodes of the task
    render with it."""
    base = task_label(name).removesuffix(UNSEMANTIC)
    fields = {**(_read_prompt(folder) if folder is not None else {}),
              **{k: v for k, v in (prompt or {}).items() if v is not None}}
    template = template_for(base)
    if fields:
        template = template.model_copy(update=fields)
        register_template(base, template)
    return template


def load_task_folder(folder: Path | str, name: str | None = None,
                     prompt: dict[str, str | None] | None = None) -> ClassificationTask:
    """A task from its folder (the module docstring says what it holds); `name` defaults to the folder's name."""
    folder = Path(folder)
    name = name or task_label(str(folder))
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise UserError(f"task '{name}': {folder} {what} (a task folder holds {', '.join(TASK_FILES)})")
    labels = _read_labels(folder)
    if (folder / "label_map.tsv").exists():  # the built-in tasks: the paper's label text, in the paper's order
        label_map = _read_label_map(folder)
        unknown = sorted(set(label_map) - set(labels))
        if unknown:
            raise UserError(f"{folder / 'label_map.tsv'}: label(s) not in labels.txt: {', '.join(unknown)}")
    else:
        label_map = {label: label for label in labels}
    train = _read_split(folder / "train.jsonl", label_map)
    test = _read_split(folder / "test.jsonl", label_map)
    base = task_label(name).removesuffix(UNSEMANTIC)
    task = ClassificationTask(base, list(label_map.values()), train, test, task_template(base, folder, prompt))
    return make_unsemantic(task) if name.endswith(UNSEMANTIC) else task


def load_task_from_dir(name: str, tasks_dir: Path | str,
                       prompt: dict[str, str | None] | None = None) -> ClassificationTask:
    """A task folder (or its `_unsemantic` variant): `name` is a path, or a folder name under `tasks_dir`."""
    folder = task_folder(name, tasks_dir)
    if folder is None:
        base = name.removesuffix(UNSEMANTIC)
        raise UserError(f"task '{base}' not found: {Path(tasks_dir) / base} does not exist (set data.tasks_dir to "
                        "the folder holding the task folders, or give the task folder's path)")
    if is_task_path(name):
        return load_task_folder(folder, prompt=prompt)
    return load_task_folder(folder, name, prompt)


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


def folder_tasks(tasks_dir: Path | str | None) -> list[str]:
    """Names of the task folders under `tasks_dir` (the built-in ones and any a user added)."""
    if tasks_dir is None or not Path(tasks_dir).is_dir():
        return []
    return sorted(child.name for child in Path(tasks_dir).iterdir()
                  if child.is_dir() and all((child / f).is_file() for f in TASK_FILES))


def available_tasks(tasks_dir: Path | str | None = None) -> list[str]:
    """Every task name: the paper's five, their _unsemantic variants, other task folders under `tasks_dir`,
    the synthetic tasks."""
    extra = [t for t in folder_tasks(tasks_dir) if t not in REAL_TASKS and t not in SYNTHETIC_TASKS]
    return list(REAL_TASKS) + [t + UNSEMANTIC for t in REAL_TASKS] + extra + list(SYNTHETIC_TASKS)


def load_task(name: str, tasks_dir: Path | str, seed: int = 0,
              prompt: dict[str, str | None] | None = None) -> ClassificationTask:
    """Any task: synthetic ones are generated from `seed`; a path or a folder under `tasks_dir` is read from
    disk (`prompt`: prompt prefixes over the task's own)."""
    if name in SYNTHETIC_TASKS:
        task = SYNTHETIC_TASKS[name](seed=seed)
        if prompt:
            task.template = task_template(name, None, prompt)
        return task
    if is_task_path(name) or name.removesuffix(UNSEMANTIC) in REAL_TASKS or task_folder(name, tasks_dir):
        return load_task_from_dir(name, tasks_dir, prompt)
    raise UserError(f"unknown task '{name}'; available: {', '.join(available_tasks(tasks_dir))}, or the path of a "
                    f"task folder ({', '.join(TASK_FILES)}; docs/TASKS.md)")


def register_task_templates(data) -> None:
    """Register the prompt template of every task source in `data` (a DataConfig) whose prompt differs from
    the built-in one (a folder's prompt.yaml, data.task_prompts), without reading its splits: a process that
    renders episodes of such a task (tokenize, PPO, a Ray worker) writes them as the dataset build did."""
    for source in data.sources:
        if getattr(source, "kind", None) in ("task", "synthetic"):
            task_template(source.name, task_folder(source.name, data.tasks_dir), data.prompt_of(source.name))


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
    except Exception as exc:  # noqa: BLE001 - offline, not cached, or the Hub refused: a UserError either way
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
    except Exception as exc:  # noqa: BLE001 - datasets raises many types for a folder it cannot read
        raise UserError(f"{path}: not a saved dataset ({type(exc).__name__}: {str(exc)[:200]})") from None
    if isinstance(dataset, datasets.Dataset):
        dataset = datasets.DatasetDict({"train": dataset})
    return task_from_dataset_dict(name, dataset, _optional_label_map(name, tasks_dir))


def load_task_from_source(name: str, source: str, tasks_dir: Path | str, seed: int = 0,
                          disk_path: Path | str | None = None,
                          prompt: dict[str, str | None] | None = None) -> ClassificationTask:
    """`load_task` with a choice of where real tasks come from: 'dir' (tasks_dir), 'hub' or 'disk'."""
    if name in SYNTHETIC_TASKS or source == "dir" or is_task_path(name):
        return load_task(name, tasks_dir, seed=seed, prompt=prompt)
    if source == "hub":
        task = load_task_from_hub(name, tasks_dir)
    elif source == "disk":
        if disk_path is None:
            raise UserError("source=disk needs a disk_path (a folder written by DatasetDict.save_to_disk)")
        task = load_task_from_disk(name, disk_path, tasks_dir)
    else:
        raise UserError(f"unknown task source '{source}' (dir, hub, disk)")
    if prompt:
        task.template = task_template(name, None, prompt)
    return task
