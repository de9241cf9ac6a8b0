"""`icrl eval`'s inputs and logs without the console script: the Hugging Face dataset path (a DatasetDict saved
to disk), the JSONL reader, and a run folder of the one-number p_keep resuming. The command end to end:
tests/integration/test_icrl_eval_cli.py."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ROOT


def test_hub_dataset_path_offline_via_save_to_disk(tmp_path, tasks_dir):
    """The Hub conversion (ClassLabel ids -> dataset label names -> the paper's label text) on a DatasetDict
    shaped like CogComp/trec, saved to disk and loaded back."""
    import datasets

    from icrl_core.task_data import load_task, load_task_from_disk, load_task_from_source

    real = load_task("trec_fine", tasks_dir)
    fine_names = [line.split("\t")[0] for line in (tasks_dir / "trec_fine" / "label_map.tsv").read_text()
                  .splitlines()[1:]]
    features = datasets.Features({
        "text": datasets.Value("string"),
        "coarse_label": datasets.ClassLabel(names=["ABBR", "ENTY", "DESC", "HUM", "LOC", "NUM"]),
        "fine_label": datasets.ClassLabel(names=fine_names),
    })
    rows = {"text": ["What does the acronym NASA mean here ?", "Who wrote Hamlet ?", "How far is the moon ?"],
            "coarse_label": [0, 3, 5], "fine_label": [1, 29, 40]}
    data = datasets.DatasetDict({split: datasets.Dataset.from_dict(rows, features=features)
                                 for split in ("train", "test")})
    data.save_to_disk(str(tmp_path / "trec"))

    coarse = load_task_from_disk("trec_coarse", tmp_path / "trec", tasks_dir)
    assert [e.label for e in coarse.train] == ["abbreviation", "human", "numeric"]
    assert coarse.labels == load_task("trec_coarse", tasks_dir).labels
    fine = load_task_from_source("trec_fine", "disk", tasks_dir, disk_path=tmp_path / "trec")
    assert fine.labels == real.labels
    assert [e.label for e in fine.test] == ["abbreviation expansion", "human individual", "numeric distance"]
    assert fine.template.query_prefix == "Question:"
    unsemantic = load_task_from_disk("trec_coarse_unsemantic", tmp_path / "trec", tasks_dir)
    assert all(label.startswith("L") for label in unsemantic.labels)

    # The NLU dataset has one split: it is split 80/20 with seed 0 as the paper does.
    nlu = datasets.DatasetDict({"train": datasets.Dataset.from_dict(
        {"text": [f"utterance {i}" for i in range(20)], "label": [i % 2 for i in range(20)]},
        features=datasets.Features({"text": datasets.Value("string"),
                                    "label": datasets.ClassLabel(names=["alarm_query", "alarm_set"])}))})
    nlu.save_to_disk(str(tmp_path / "nlu"))
    task = load_task_from_disk("nlu", tmp_path / "nlu")
    assert len(task.train) == 16 and len(task.test) == 4 and task.labels == ["alarm query", "alarm set"]
    from icrl_core.errors import UserError

    with pytest.raises(UserError, match="save_to_disk"):
        load_task_from_disk("trec_coarse", tmp_path / "missing")
    assert ROOT.exists()


def test_jsonl_reader_drops_only_a_truncated_last_line(tmp_path):
    from icrl_core.errors import UserError
    from tasks.icrl_eval import read_jsonl

    path = tmp_path / "steps.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "qu')
    assert read_jsonl(path) == ([{"step": 0}, {"step": 1}], True)
    path.write_text('{"step": 0}\n{"step": 1}\n')
    assert read_jsonl(path) == ([{"step": 0}, {"step": 1}], False)
    path.write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(UserError, match="steps.jsonl:2"):
        read_jsonl(path)


def test_a_run_folder_of_the_one_number_p_keep_resumes(tmp_path):
    """A run written when icrl_eval.p_keep was one number resumes under the per-strategy form of the same
    value, and not under another value."""
    from icrl_core.errors import UserError
    from tasks.icrl_eval import _check_resumable
    from tasks.settings import load_config, with_overrides

    config = with_overrides(load_config(), {"icrl_eval.p_keep": 0.3})
    saved = config.model_dump(mode="json")
    saved["icrl_eval"]["p_keep"] = 0.3
    (tmp_path / "config.json").write_text(json.dumps(saved))
    _check_resumable(tmp_path, config)
    with pytest.raises(UserError, match="icrl_eval.p_keep"):
        _check_resumable(tmp_path, with_overrides(config, {"icrl_eval.p_keep": {"explorative": 0.5}}))
