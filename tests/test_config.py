from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from icrl_core.config import AdaptiveKL, LastBlocksAdapter
from tasks.settings import (ConfigError, PipelineConfig, config_to_flat_params, describe_fields, load_config,
                            with_overrides)
from tests.conftest import ROOT, run_cli


def write(tmp_path, data) -> str:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_defaults_hold_every_named_icrl_parameter():
    cfg = PipelineConfig()
    assert cfg.data.k_exemplars == 3
    assert cfg.data.n_queries == 1
    assert cfg.data.episode_tokens == 2048
    assert cfg.ppo.value_head is True
    assert cfg.ppo.epochs == 4
    assert cfg.ppo.kl_beta == 0.01
    assert cfg.ppo.entropy_beta == 0.01
    assert cfg.ppo.epsilon_mixture == 0.1
    assert cfg.ppo.reward_model_path is None
    for section in (cfg.bootstrap, cfg.reward_model, cfg.ppo):
        for name in ("learning_rate", "batch_size", "grad_accum", "max_steps", "save_steps"):
            assert hasattr(section, name)
    assert cfg.model.spec == "smollm2-135m"
    assert isinstance(cfg.seed, int)


def test_precedence_cli_over_env_over_file_over_defaults(tmp_path):
    params = write(tmp_path, {"ppo": {"kl_beta": 0.03, "epochs": 2, "entropy_beta": 0.5}})
    env = {"ICRL_PPO__KL_BETA": "0.04", "ICRL_PPO__EPOCHS": "3"}
    cfg = load_config(params, ["ppo.kl_beta=0.05"], environ=env)
    assert cfg.ppo.kl_beta == 0.05  # CLI wins
    assert cfg.ppo.epochs == 3  # env over file
    assert cfg.ppo.entropy_beta == 0.5  # file over default
    assert cfg.ppo.clip_range == 0.2  # default


def test_env_override_of_nested_discriminated_section():
    cfg = load_config(None, [], environ={"ICRL_MODEL__ADAPTER__KIND": "last_blocks",
                                         "ICRL_MODEL__ADAPTER__N_BLOCKS": "3"})
    assert cfg.model.adapter == LastBlocksAdapter(n_blocks=3)


def test_switching_variant_drops_keys_of_the_old_variant():
    cfg = load_config(None, ["ppo.kl_control={kind: adaptive, target: 0.2}"], environ={})
    assert cfg.ppo.kl_control == AdaptiveKL(target=0.2)
    cfg = load_config(None, ["model.adapter.kind=last_blocks"], environ={})
    assert cfg.model.adapter == LastBlocksAdapter()


@pytest.mark.parametrize(
    "override, expected",
    [
        ("ppo.kl_bta=1", ["ppo.kl_bta: unknown key", "kl_beta", "entropy_beta"]),
        ("ppo.kl_beta=-1", ["ppo.kl_beta", "greater than or equal to 0"]),
        ("model.dtype=fp16", ["model.dtype", "'float32', 'bfloat16' or 'auto'", "fp16"]),
        ("model.adapter.rnk=4", ["model.adapter.rnk: unknown key", "rank"]),
        ("model.adapter.kind=qlora", ["model.adapter", "'lora', 'last_blocks', 'none'"]),
        ("icrl_eval.strategy=greedy", ["icrl_eval.strategy", "'naive'", "'explorative'"]),
        ("nosuchsection.x=1", ["nosuchsection: unknown key", "ppo", "bootstrap"]),
        ("evaluate.reuse_base_runs=true", ["evaluate.reuse_base_runs: renamed to evaluate.reuse_runs"]),
    ],
)
def test_errors_name_the_key_and_allowed_values(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override], environ={})
    for fragment in expected:
        assert fragment in str(info.value)


def test_bad_env_variable_is_an_error():
    with pytest.raises(ConfigError, match="ppo.klbeta: unknown key"):
        load_config(None, [], environ={"ICRL_PPO__KLBETA": "1"})


def test_set_needs_key_value():
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(None, ["ppo.kl_beta"], environ={})


def test_with_overrides_and_flat_params_redact_credentials():
    cfg = with_overrides(PipelineConfig(), {"ppo.learning_rate": 3e-5,
                                            "tracking.tracking_uri": "http://alice:s3cret@127.0.0.1:5000"})
    assert cfg.ppo.learning_rate == 3e-5
    flat = config_to_flat_params(cfg)
    assert flat["ppo.learning_rate"] == "3e-05"
    assert "s3cret" not in flat["tracking.tracking_uri"]


def test_every_leaf_field_is_documented():
    rows = describe_fields()
    undocumented = [key for key, _, description in rows if not description]
    assert not undocumented, undocumented


def test_params_yaml_of_the_repo_is_valid():
    from tests.conftest import ROOT

    cfg = load_config(ROOT / "params.yaml", [], environ={})
    assert cfg.model.spec == "smollm2-135m"


def test_cli_reports_bad_override_with_exit_code_2(tmp_path):
    result = run_cli("config", "show", "--set", "ppo.kl_bta=1", cwd=tmp_path)
    assert result.returncode == 2
    assert "ppo.kl_bta: unknown key" in result.stderr
    result = run_cli("config", "show", "--set", "ppo.kl_beta=0.02", cwd=tmp_path,
                     env={"ICRL_PPO__EPOCHS": "7"})
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["ppo"]["kl_beta"] == 0.02 and shown["ppo"]["epochs"] == 7


def test_every_cli_command_documents_every_option():
    """`--help` of each command lists each option with a help text."""
    import click
    import typer.main

    from tasks.cli import app

    root = typer.main.get_command(app)

    def walk(command, path):
        yield path, command
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                yield from walk(sub, path + [name])

    for path, command in walk(root, ["icrl"]):
        assert command.help or isinstance(command, click.Group) or command.callback.__doc__, path
        for param in command.params:
            if isinstance(param, click.Option) and param.name != "help":
                assert param.help, f"{' '.join(path)} {param.opts} has no help"
            if isinstance(param, click.Argument):
                assert getattr(param, "help", None), f"{' '.join(path)} argument {param.name} has no help"


def test_process_variables_with_the_prefix_are_not_config_keys():
    from tasks.settings import env_overrides

    environ = {"ICRL_MLFLOW_PARENT_RUN_ID": "abc", "ICRL_PROJECT_DIR": "/x", "ICRL_SEED": "7",
               "ICRL_PPO__KL_BETA": "0.5"}
    assert env_overrides(environ) == {"seed": 7, "ppo": {"kl_beta": 0.5}}


def test_experiment_files_are_dotted_overrides_and_bad_ones_are_user_errors(tmp_path):
    from flows.cli import read_experiment
    from tasks.settings import load_config
    from icrl_core.errors import ConfigError

    overrides = read_experiment(Path(__file__).resolve().parents[1] / "experiments" / "icrl_skill.yaml")
    config = load_config(None, [], environ={}, extra=None)
    assert overrides["icrl_eval.task"] == "trec_coarse"
    # the held-out tasks never feed training data
    assert not any("trec" in s["name"] or "nlu" in s["name"] for s in overrides["data.sources"])
    assert not any("trec" in name or "nlu" in name for name in overrides["bootstrap.replay"]["tasks"])
    from flows.pipeline import apply_overrides

    params = tmp_path / "params.yaml"
    params.write_text("seed: 0\n")
    apply_overrides(overrides, str(params))
    experiment = load_config(params, [], environ={})
    assert experiment.data.exemplar_style == "feedback"
    assert experiment.bootstrap.replay.beta > 0  # recipe H: general-chat replay on
    # one backward pass holds at most ~2 episodes of activations (4 pairs of 1536-token episodes were OOM-killed
    # on the 24 GB machine): bootstrap episodes, reward-model pairs (2 episodes each), PPO and adapt minibatches
    budget = 2 * experiment.data.episode_tokens
    assert experiment.bootstrap.batch_size * experiment.data.episode_tokens <= budget
    assert experiment.reward_model.batch_size * 2 * experiment.data.episode_tokens <= budget
    assert experiment.ppo.minibatch_size * experiment.data.episode_tokens <= budget
    assert experiment.adapt.minibatch_size * experiment.data.episode_tokens <= budget
    assert experiment.adapt.rollout_batch * experiment.data.episode_tokens <= 4 * budget  # KV caches, no grads
    assert config.icrl_eval.task != "trec_coarse"
    for text in ("[1, 2]", "a: [", "1: 2"):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match="bad.yaml"):
            read_experiment(bad)
    with pytest.raises(ConfigError, match="not found"):
        read_experiment(tmp_path / "missing.yaml")


def test_config_reference_in_docs_is_generated_from_the_schema():
    result = run_cli("config", "docs")
    assert result.returncode == 0, result.stderr
    assert (ROOT / "docs" / "CONFIG.md").read_text() == result.stdout, "regenerate: icrl config docs --output docs/CONFIG.md"
