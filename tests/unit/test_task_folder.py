"""A user's own classification task: a folder (train.jsonl, test.jsonl, labels.txt; optional label_map.tsv and
prompt.yaml) works wherever a built-in task does: by path or by name under data.tasks_dir, in `icrl eval`, in
data.sources, in `icrl tasks`; its prompt prefixes come from prompt.yaml and data.task_prompts. Bad folders are
one clear error (exit 2). The texts are synthetic, generated here."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from icrl_core.config import DataConfig, TaskSource
from icrl_core.dataset_build import build_episodes, resolve_sources
from icrl_core.episodes import render_episode
from icrl_core.errors import UserError
from icrl_core.prompting import TEMPLATES, template_for
from icrl_core.task_data import load_task, register_task_templates
from tests.conftest import call_cli

WORDS = {"warm": ["sun", "fire", "summer", "oven"], "cold": ["snow", "ice", "winter", "frost"],
         "wet": ["rain", "river", "sea", "puddle"]}


def make_task(folder: Path, n_train: int = 30, n_test: int = 12, prompt: str | None = "query_prefix: 'Note:'\n"
              "answer_prefix: 'Feel:'\n", seed: int = 0) -> Path:
    """A small synthetic task folder: 'I thought about the <word> today.' -> the word's group."""
    rng = random.Random(seed)
    folder.mkdir(parents=True)

    def rows(n: int) -> str:
        out = []
        for _ in range(n):
            label = rng.choice(list(WORDS))
            out.append(json.dumps({"text": f"I thought about the {rng.choice(WORDS[label])} today.",
                                   "label": label}))
        return "\n".join(out) + "\n"

    (folder / "train.jsonl").write_text(rows(n_train))
    (folder / "test.jsonl").write_text(rows(n_test))
    (folder / "labels.txt").write_text("\n".join(WORDS) + "\n")
    if prompt is not None:
        (folder / "prompt.yaml").write_text(prompt)
    return folder


@pytest.fixture(autouse=True)
def _templates():
    """Loading a task registers its template: leave the registry as it was."""
    before = dict(TEMPLATES)
    yield
    TEMPLATES.clear()
    TEMPLATES.update(before)


def call(argv: list[str]) -> tuple[int, str, str]:
    done = call_cli(*argv, cwd=Path.cwd())
    return done.returncode, done.stdout, done.stderr


def test_a_folder_is_a_task_by_path_and_by_name(tmp_path, monkeypatch):
    make_task(tmp_path / "tasks" / "feelings")
    monkeypatch.chdir(tmp_path / "tasks" / "feelings")
    assert load_task(".", "/nonexistent").name == load_task("../feelings/", "/nonexistent").name == "feelings"
    by_path = load_task(str(tmp_path / "tasks" / "feelings"), "/nonexistent")
    by_name = load_task("feelings", tmp_path / "tasks")
    assert by_path.name == by_name.name == "feelings"
    assert by_path.labels == ["warm", "cold", "wet"]  # labels.txt order
    assert len(by_path.train) == 30 and len(by_path.test) == 12 and by_path.train == by_name.train
    assert (by_path.template.query_prefix, by_path.template.answer_prefix) == ("Note:", "Feel:")
    assert template_for("feelings").query_prefix == "Note:"  # registered: its episodes render with it
    opaque = load_task("feelings_unsemantic", tmp_path / "tasks")
    assert opaque.labels[0].startswith("L") and opaque.template.answer_prefix == "Feel:"
    # data.task_prompts wins over prompt.yaml; without prompt.yaml the generic template
    assert load_task("feelings", tmp_path / "tasks", prompt={"query_prefix": "Diary:"}).template.query_prefix == \
        "Diary:"
    plain = load_task(str(make_task(tmp_path / "plain", prompt=None)), tmp_path)
    assert plain.template.query_prefix == "" and plain.labels == ["warm", "cold", "wet"]


def test_bad_task_folders_are_one_clear_error(tmp_path):
    cases = {}
    folder = make_task(tmp_path / "no_labels")
    (folder / "labels.txt").unlink()
    cases[folder] = "labels.txt: label list not found"
    folder = make_task(tmp_path / "unknown_label")
    with open(folder / "test.jsonl", "a") as handle:
        handle.write(json.dumps({"text": "I thought about the fog today.", "label": "grey"}) + "\n")
    cases[folder] = "test.jsonl:13: label \"grey\" is not in labels.txt"
    folder = make_task(tmp_path / "latin1")
    (folder / "train.jsonl").write_bytes('{"text": "caf\u00e9", "label": "warm"}\n'.encode("latin-1"))
    cases[folder] = "train.jsonl: the task split is not UTF-8"
    folder = make_task(tmp_path / "bad_prompt", prompt="query_prefx: 'x'\n")
    cases[folder] = "prompt.yaml: expected text values for some of query_prefix"
    cases[tmp_path / "missing"] = "does not exist"
    (tmp_path / "a_file").write_text("x")
    cases[tmp_path / "a_file"] = "is not a folder"
    for folder, message in cases.items():
        with pytest.raises(UserError, match=None) as info:
            load_task(str(folder), tmp_path)
        assert message in str(info.value), (folder, info.value)
    with pytest.raises(UserError, match="unknown task 'nosuch'.*the path of a task folder"):
        load_task("nosuch", tmp_path)


def test_icrl_eval_and_icrl_tasks_on_a_task_folder(tmp_path, monkeypatch, tiny):
    """End to end on the tiny model, in-process: a folder the project has never seen, the paper's strategy name,
    p_keep below 1 for naive, and a trained adapter given with --adapter."""
    monkeypatch.chdir(tmp_path)
    folder = make_task(tmp_path / "data" / "feelings")
    adapter = tmp_path / "adapter"
    from icrl_core.model import policy_from_config
    from tasks.settings import load_config, with_overrides

    policy_from_config(with_overrides(load_config(), {"model.spec": "tiny", "model.dtype": "float32"}).model
                       ).save_adapter(adapter)
    code, out, err = call(["eval", "--task", str(folder), "--model", "tiny", "--dtype", "float32", "--adapter",
                           str(adapter), "--strategy", "random_biased_end", "--p-keep", "0.5", "--train-k", "6",
                           "--test-every", "3", "--test-k", "4", "--debug-k", "1", "--threads", "1",
                           "--output-dir", str(tmp_path / "runs"), "--no-tracking", "--no-progress"])
    assert code == 0, err
    run = tmp_path / "runs" / "feelings-naive-seed100"
    config = json.loads((run / "config.json").read_text())
    assert config["icrl_eval"]["task"] == str(folder) and config["icrl_eval"]["strategy"] == "naive"
    assert config["icrl_eval"]["p_keep"]["naive"] == 0.5 and config["model"]["init_adapter"] == str(adapter)
    assert "Note: I thought about the" in out and "Feel:" in out  # prompt.yaml's prefixes in the printed prompt
    steps = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 6 and {s["gold"] for s in steps} <= {"warm", "cold", "wet"}

    code, out, err = call(["tasks", str(folder), "--set", f"data.tasks_dir={folder.parent}"])
    assert code == 0 and "feelings" in out and "Note:" in out, err
    code, out, err = call(["tasks", "--set", f"data.tasks_dir={folder.parent}"])
    assert code == 0 and "feelings" in out and "banking77" in out, err

    for bad, message in ((tmp_path / "nothing", "does not exist"), (tmp_path / "adapter", "label list not found")):
        code, _, err = call(["eval", "--task", str(bad), "--model", "tiny", "--no-tracking"])
        assert code == 2 and message in err and "Traceback" not in err, err
    code, _, err = call(["tasks", str(tmp_path / "nothing")])
    assert code == 2 and "does not exist" in err


def test_a_task_folder_as_a_dataset_source(tmp_path, tokens):
    folder = make_task(tmp_path / "feelings")
    data = DataConfig(sources=[TaskSource(name=str(folder))], num_episodes=8, k_exemplars=2, n_queries=1,
                      val_fraction=0.25, task_prompts={str(folder): {"task_description": "Group the word."}})
    built = build_episodes(resolve_sources(data, 0), data, 0)
    assert len(built) == 8 and {b.episode.task_type for b in built} == {"feelings"}
    TEMPLATES.pop("feelings")  # a fresh process (tokenize, a Ray worker) registers it from the config alone
    register_task_templates(data)
    text = tokens.decode(render_episode(built[0].episode, tokens, 2048).input_ids)
    assert "Note: I thought about the" in text and "Feel:" in text and "Group the word." in text


def test_the_stages_build_and_tokenize_a_task_folder_from_an_experiment_file(tmp_path, monkeypatch):
    """An experiment file names the folder as a data source; tokenize, in a fresh process (the registry emptied
    here), renders its episodes with the folder's prompt.yaml and the config's task_prompts."""
    import glob

    from icrl_core.tokenized import load_tokenizer, read_tokenized

    monkeypatch.chdir(tmp_path)
    make_task(tmp_path / "feelings")
    (tmp_path / "exp.yaml").write_text(
        "data.sources: [{kind: task, name: ./feelings}]\ndata.num_episodes: 8\n"
        "data.task_prompts: {./feelings: {task_description: Group the word.}}\n"
        "model.spec: tiny\nmodel.dtype: float32\ntracking.enabled: false\n")
    code, _, err = call(["stage", "build_dataset", "-c", "exp.yaml"])
    assert code == 0, err
    TEMPLATES.pop("feelings")
    code, _, err = call(["stage", "tokenize", "-c", "exp.yaml"])
    assert code == 0, err
    rows = read_tokenized(glob.glob("artifacts/tokenized/*.parquet")[0])
    text = load_tokenizer("tiny").decode(rows[0].input_ids)
    assert "Group the word." in text and "Note: I thought about the" in text and "Feel:" in text


def test_the_evaluate_stage_knows_a_task_folder_by_its_files_and_prompt(tmp_path):
    """Finished base runs are reused by result_key: editing the task folder or its prompt makes another key."""
    from tasks.evaluate import result_key
    from tasks.settings import load_config, with_overrides

    folder = make_task(tmp_path / "feelings")
    config = with_overrides(load_config(), {"icrl_eval.task": str(folder), "model.dtype": "float32"})
    key = result_key(config)
    assert result_key(config) == key
    assert result_key(with_overrides(config, {"data.task_prompts": {str(folder): {"query_prefix": "Q:"}}})) != key
    with open(folder / "test.jsonl", "a") as handle:
        handle.write(json.dumps({"text": "I thought about the ice today.", "label": "cold"}) + "\n")
    assert result_key(config) != key
