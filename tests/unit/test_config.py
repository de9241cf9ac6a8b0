from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from icrl_core.config import AdaptiveKL, LastBlocksAdapter
from tasks.settings import (
    ConfigError,
    PipelineConfig,
    config_to_flat_params,
    describe_fields,
    load_config,
    with_overrides,
)
from tests.conftest import ROOT


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


def test_experiment_files_layer_on_params_and_are_written_into_it_as_dvc_sees_them(tmp_path):
    from flows.pipeline import apply_overrides
    from tasks.settings import params_file_overrides, read_config_file

    skill = ROOT / "experiments" / "icrl_skill.yaml"
    layer = read_config_file(skill)  # dotted keys -> nested sections
    assert layer["icrl_eval"]["task"] == "trec_coarse"
    # the held-out tasks never feed training data
    assert not any("trec" in s["name"] or "nlu" in s["name"] for s in layer["data"]["sources"])
    assert not any("trec" in name or "nlu" in name for name in layer["bootstrap"]["replay"]["tasks"])
    params = tmp_path / "params.yaml"
    params.write_text("seed: 0\n")
    layered = load_config([params, skill], [], environ={})
    # `icrl pipeline -c params.yaml -c skill.yaml` (or --experiment): the changed keys go into params.yaml
    apply_overrides(params_file_overrides(params, [params, skill]), str(params))
    experiment = load_config(params, [], environ={})
    assert experiment == layered
    assert params_file_overrides(params, [params]) == {}  # params.yaml alone: nothing to write
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
    assert load_config(None, [], environ={}).icrl_eval.task != "trec_coarse"
    for text in ("[1, 2]", "a: [", "1: 2"):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match="bad.yaml"):
            read_config_file(bad)
    with pytest.raises(ConfigError, match="not found"):
        read_config_file(tmp_path / "missing.yaml")


def test_the_skill_recipe_trains_setting_16s_rl_stage_and_evaluates_it_against_the_bootstrap():
    """Issue 26, Deliver 4: `make experiment` trains bootstrap -> RL with setting 16's layers (the best measured),
    evaluates and promotes the RL adapter with the bootstrap beside it; the pre-registered runs (run.sh's
    h32_ppo.yaml after the recipe) still compose the token-mode recipe they ran with."""
    from tasks.settings import config_diff

    stream_rl = ROOT / "experiments" / "icrl_stream_rl"
    skill = [ROOT / "params.yaml", ROOT / "experiments" / "icrl_skill.yaml"]
    recipe = load_config(skill, [], environ={})
    as_run = skill + [stream_rl / "h32_ppo.yaml"]
    setting_16 = load_config(as_run + [stream_rl / name for name in
                                       ("stream_rl.yaml", "explorative_streams.yaml", "burn_in_streams.yaml")],
                             [], environ={})
    assert config_diff(setting_16, recipe) == {
        "ppo.output_dir": "artifacts/ppo", "evaluate.adapter": "artifacts/ppo/adapter",
        "evaluate.start_adapter": "artifacts/bootstrap/adapter", "evaluate.min_gain_over_start": 0.0}
    assert recipe.ppo.init_adapter == Path(recipe.bootstrap.output_dir) / "adapter"
    assert recipe.evaluate.adapter == Path(recipe.ppo.output_dir) / "adapter"
    assert recipe.evaluate.start_adapter == recipe.ppo.init_adapter
    h32 = load_config(as_run, [], environ={})
    assert (h32.ppo.mode, h32.ppo.objective.kind, h32.ppo.max_steps) == ("token", "ppo", 4)
    assert h32.evaluate.adapter == recipe.ppo.init_adapter and h32.evaluate.start_adapter is None
    changed = config_diff(h32, recipe)
    assert changed and all(key.startswith(("ppo.", "evaluate.", "model.gradient_checkpointing")) for key in changed)
    assert recipe.bootstrap == h32.bootstrap and recipe.data == h32.data and recipe.icrl_eval == h32.icrl_eval


def test_params_file_takes_what_the_layers_say_even_when_it_is_not_one_of_them(tmp_path):
    """Written into params.yaml, the layers give the same config: kind changes replace the section, keys of
    params.yaml that no layer names return to their defaults, --set wins."""
    from flows.pipeline import apply_overrides
    from tasks.settings import params_file_overrides

    params = tmp_path / "params.yaml"
    params.write_text("# the demo\nseed: 3  # kept comment\nmodel:\n  adapter: {kind: lora, rank: 4}\n"
                      "ppo:\n  epochs: 2\n  kl_control: {kind: adaptive, target: 0.3}\n")
    base = tmp_path / "base.yaml"
    base.write_text("seed: 3\nmodel.adapter: {kind: last_blocks, n_blocks: 1}\n"
                    "sweep.search_space.ppo.epochs: {kind: choice, values: [1, 2]}\n")
    sets = ["ppo.kl_beta=0.07", "data.sources=[{kind: task, name: banking77}]"]
    target = load_config([base], sets, environ={})
    apply_overrides(params_file_overrides(params, [base], sets), str(params))
    assert load_config(params, [], environ={}) == target
    assert target.ppo.epochs == 4 and target.ppo.kl_control.kind == "fixed"  # params.yaml was not a layer
    assert target.model.adapter == LastBlocksAdapter(n_blocks=1)
    assert list(target.sweep.search_space) == ["ppo.epochs"]
    assert "seed: 3  # kept comment" in params.read_text()


def test_config_files_mix_sections_and_dotted_keys_and_later_files_win(tmp_path):
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text("ppo: {epochs: 2, kl_beta: 0.3}\nppo.clip_range: 0.1\nmodel.adapter: {kind: lora, rank: 4}\n")
    second.write_text("ppo.epochs: 3\nmodel: {adapter.rank: 2}\n")
    config = load_config([first, second], [], environ={})
    assert (config.ppo.epochs, config.ppo.kl_beta, config.ppo.clip_range) == (3, 0.3, 0.1)
    assert config.model.adapter.rank == 2


def _three_layers(tmp_path) -> list[Path]:
    """A base, an experiment and a local file; each sets keys, later ones override some of the earlier."""
    files = [tmp_path / "base.yaml", tmp_path / "experiment.yaml", tmp_path / "local.yaml"]
    files[0].write_text("seed: 5\nppo: {kl_beta: 0.03, epochs: 2, entropy_beta: 0.2}\n")
    files[1].write_text("ppo.epochs: 3\nmodel: {spec: tiny, adapter: {kind: last_blocks, n_blocks: 1}}\n")
    files[2].write_text("model.dtype: float32\nppo.entropy_beta: 0.3\n")
    return files


BAD_FILES = {  # what a bad layer holds -> what the error must say besides the file name
    "yaml": ("ppo: {kl_beta: [\n", "not valid YAML"),
    "unknown_key": ("ppo.kl_bta: 1\n", "ppo.kl_bta: unknown key"),
    "bad_value": ("ppo: {kl_beta: -1}\n", "ppo.kl_beta: Input should be greater than or equal to 0"),
    "not_utf8": (b"seed: 1 # caf\xe9\n", "not UTF-8"),
    "missing": (None, "config file not found"),
    "directory": ("dir", "is a directory"),
}


def _bad_layer(tmp_path, kind: str) -> Path:
    content = BAD_FILES[kind][0]
    path = tmp_path / f"bad-{kind}.yaml"
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    return path


@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_a_bad_file_in_any_layer_is_named_with_its_key(tmp_path, kind, position):
    files = _three_layers(tmp_path)
    files[position] = _bad_layer(tmp_path, kind)
    with pytest.raises(ConfigError) as info:
        load_config(files, ["seed=1"], environ={})
    message = str(info.value)
    assert str(files[position]) in message and BAD_FILES[kind][1] in message, message
    assert not any(str(other) in message for other in files if other != files[position]), message


def test_errors_name_the_variable_or_set_item_of_a_bad_value():
    with pytest.raises(ConfigError, match=r"ppo.kl_beta: .*\[from ICRL_PPO__KL_BETA\]"):
        load_config(None, [], environ={"ICRL_PPO__KL_BETA": "-1"})
    with pytest.raises(ConfigError, match=r"data.sources.0.name: Field required .*\[from --set data.sources="):
        load_config(None, ["data.sources=[{kind: task}]"], environ={})


def test_at_file_is_short_for_dash_c():
    from tasks.cli_common import expand_at_files

    assert expand_at_files(["pipeline", "@a.yaml", "@", "b.yaml", "--set", "x=@y"]) == \
        ["pipeline", "-c", "a.yaml", "-c", "b.yaml", "--set", "x=@y"]


def test_debug_config_layers_on_params_yaml():
    config = load_config([ROOT / "params.yaml", ROOT / "experiments" / "debug" / "tiny.yaml"], [], environ={})
    assert config.model.spec == "tiny" and config.model.dtype == "float32"
    assert config.model.adapter.kind == "lora"  # from params.yaml
    assert max(config.bootstrap.max_steps, config.reward_model.max_steps, config.ppo.max_steps) <= 2


@pytest.mark.parametrize("order", [("kind", "knob"), ("knob", "kind")])
def test_a_sweep_can_replace_the_objective_by_its_kind(order):
    """Ray Tune hands a trial {'ppo.objective.kind': ..., ...} in any order; the kind replaces the section first."""
    base = with_overrides(PipelineConfig(), {"ppo.mode": "stream"})
    assert base.ppo.objective.kind == "ppo"
    items = {"kind": ("ppo.objective.kind", "aipo"), "knob": ("ppo.objective.delta", 3.0)}
    cfg = with_overrides(base, dict(items[key] for key in order))
    assert cfg.ppo.objective.kind == "aipo" and cfg.ppo.objective.delta == 3.0
    for kind in ("grpo", "rloo", "dr_grpo", "gspo", "opo", "ppo"):
        assert with_overrides(cfg, {"ppo.objective.kind": kind}).ppo.objective.kind == kind


def test_group_objectives_need_stream_rollouts():
    with pytest.raises(ConfigError, match=r"ppo: objective.kind=grpo compares the streams of a group: set "
                                          r"ppo.mode=stream"):
        load_config(None, ["ppo.objective.kind=grpo"], environ={})
    with pytest.raises(ConfigError, match=r"needs ppo.stream.group_size >= 2"):
        load_config(None, ["ppo.mode=stream", "ppo.objective.kind=rloo", "ppo.stream.group_size=1"], environ={})
    with pytest.raises(ConfigError, match=r"ppo.objective.clip_range: unknown key; allowed keys here: clip_high"):
        load_config(None, ["ppo.mode=stream", "ppo.objective.kind=grpo", "ppo.objective.clip_range=0.1"],
                    environ={})


def test_a_shared_burn_in_needs_burn_in_queries():
    with pytest.raises(ConfigError, match=r"ppo.stream: shared_burn_in=true shares the burn-in queries .* burn_in "
                                          r"is 0"):
        load_config(None, ["ppo.stream.shared_burn_in=true"], environ={})
    cfg = load_config(None, ["ppo.stream={burn_in: 8, shared_burn_in: true}"], environ={})
    assert cfg.ppo.stream.burn_in == 8 and cfg.ppo.stream.shared_burn_in


def test_a_burn_in_temperature_needs_burn_in_queries_and_is_positive():
    with pytest.raises(ConfigError, match=r"ppo.stream: burn_in_temperature samples the burn-in answers, and "
                                          r"burn_in is 0"):
        load_config(None, ["ppo.stream.burn_in_temperature=1.0"], environ={})
    with pytest.raises(ConfigError, match="burn_in_temperature"):
        load_config(None, ["ppo.stream={burn_in: 8, burn_in_temperature: 0}"], environ={})
    cfg = load_config(None, ["ppo.stream={burn_in: 8, burn_in_temperature: 1.0}"], environ={})
    assert cfg.ppo.stream.burn_in_temperature == 1.0 and load_config(None, [], environ={}).ppo.stream.burn_in_temperature is None


def test_stream_context_is_a_variant_and_hindsight_couples_need_the_naive_view():
    cfg = load_config(None, ["ppo.mode=stream", "ppo.stream.context={kind: explorative, p_keep: 0.3}"], environ={})
    assert cfg.ppo.stream.context.kind == "explorative" and cfg.ppo.stream.context.p_keep == 0.3
    assert load_config(None, [], environ={}).ppo.stream.context.kind == "naive"
    with pytest.raises(ConfigError, match=r"ppo.stream.context.p_keep.*greater than 0"):
        load_config(None, ["ppo.stream.context={kind: explorative, p_keep: 0}"], environ={})
    with pytest.raises(ConfigError, match=r"dpo.mine_hindsight renders each stream .* set "
                                          r"dpo.stream.context.kind=naive"):
        load_config(None, ["dpo.mine_hindsight=true", "dpo.stream.context.kind=explorative"], environ={})


def test_the_final_tests_layer_evaluates_the_kept_recipe_adapters_without_the_trec_coarse_probes():
    from tasks.settings import load_config

    config = load_config([ROOT / "params.yaml", ROOT / "experiments/icrl_skill.yaml",
                          ROOT / "experiments/icrl_stream_rl/final_tests.yaml"])
    assert str(config.evaluate.adapter) == "artifacts/recipe_rl/adapter"
    assert str(config.evaluate.start_adapter) == "artifacts/recipe_bootstrap/adapter"
    assert config.evaluate.strategies == ["explorative", "zero_shot"]
    assert config.evaluate.feedback_probe_target is None and config.evaluate.forgetting_probe_items == 0
    # the recipe's evaluation protocol is what the final tests keep
    assert (config.icrl_eval.train_k, config.icrl_eval.test_every, config.icrl_eval.test_k) == (1000, 250, 200)
    assert config.icrl_eval.seed == 100 and config.evaluate.temperatures == {"explorative": 2.0}
