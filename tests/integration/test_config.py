"""The `icrl config` commands: a bad override exits 2 naming it and `config show --origin` names where every
value comes from, through the real console script; a bad layer exits 2 naming it, and docs/CONFIG.md is
`config docs`' output, through the CLI in this process (a console script costs ~5 s per call). The config schema
and its layers: tests/unit/test_config.py."""

from __future__ import annotations

import pytest
import yaml

from tasks.settings import describe_fields, load_config
from tests.conftest import ROOT, call_cli, run_cli
from tests.unit.test_config import BAD_FILES, _bad_layer, _three_layers


def test_cli_reports_bad_override_with_exit_code_2(tmp_path):
    result = run_cli("config", "show", "--set", "ppo.kl_bta=1", cwd=tmp_path)
    assert result.returncode == 2
    assert "ppo.kl_bta: unknown key" in result.stderr
    result = run_cli("config", "show", "--set", "ppo.kl_beta=0.02", cwd=tmp_path,
                     env={"ICRL_PPO__EPOCHS": "7"})
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["ppo"]["kl_beta"] == 0.02 and shown["ppo"]["epochs"] == 7


def test_config_show_origin_names_the_file_variable_or_flag_of_every_value(tmp_path):
    base, experiment, local = _three_layers(tmp_path)
    result = run_cli("config", "show", "--origin", "-c", str(base), "--params", str(experiment), f"@{local}",
                     "--set", "ppo.kl_beta=0.5", cwd=tmp_path, env={"ICRL_PPO__VF_COEF": "0.25"})
    assert result.returncode == 0, result.stderr
    shown = {}
    for line in result.stdout.splitlines():
        entry, origin = line.rsplit("  # ", 1)
        key, value = entry.split(": ", 1)
        shown[key] = (yaml.safe_load(value), origin)
    assert shown["seed"] == (5, str(base))
    assert shown["ppo.epochs"] == (3, str(experiment))
    assert shown["ppo.entropy_beta"] == (0.3, str(local))
    assert shown["model.dtype"] == ("float32", str(local))
    assert shown["model.adapter.kind"] == ("last_blocks", str(experiment))
    assert shown["ppo.kl_beta"] == (0.5, "--set ppo.kl_beta=0.5")
    assert shown["ppo.vf_coef"] == (0.25, "ICRL_PPO__VF_COEF")
    assert shown["ppo.clip_range"] == (0.2, "default")
    # every key of the schema is listed, and the listing is itself a config file giving the same config
    for key, _, _ in describe_fields():
        assert key in shown or any(name.startswith(key + ".") for name in shown), key
    listing = tmp_path / "listing.yaml"
    listing.write_text(result.stdout)
    assert load_config([listing], [], environ={}) == load_config([base, experiment, local], ["ppo.kl_beta=0.5"],
                                                                 environ={"ICRL_PPO__VF_COEF": "0.25"})


@pytest.mark.parametrize("position, kind", [(0, "unknown_key"), (1, "not_utf8"), (2, "bad_value")])
def test_cli_exits_2_naming_the_bad_layer(tmp_path, position, kind):
    files = _three_layers(tmp_path)
    files[position] = _bad_layer(tmp_path, kind)
    args = [arg for path in files for arg in ("-c", str(path))]
    result = call_cli("config", "show", *args, cwd=tmp_path)
    assert result.returncode == 2
    assert str(files[position]) in result.stderr and BAD_FILES[kind][1] in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_config_reference_in_docs_is_generated_from_the_schema():
    result = call_cli("config", "docs", cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert (ROOT / "docs" / "CONFIG.md").read_text() == result.stdout, "regenerate: icrl config docs --output docs/CONFIG.md"
