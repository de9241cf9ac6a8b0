"""The whole pipeline config and its loader.

`PipelineConfig` hangs the algorithm and stage sections of `icrl_core/config.py` together with the orchestration
sections (tracking, Ray, Prefect, sweeps). The same pydantic models serve `params.yaml`, environment overrides
(`ICRL_PPO__KL_BETA=0.02`), CLI overrides (`--set ppo.kl_beta=0.02`), Prefect deployment parameters and Ray Tune
search spaces. Each field carries its own description and bounds, so `--help`, the generated docs and validation
all come from here.

Layers, later wins: defaults < config files in the order given (`-c base.yaml -c experiment.yaml`, or
`./params.yaml`) < environment `ICRL_*` < command options < `--set`. `icrl config show --origin` tells which layer
set each value; an error names the layer of the bad value.
"""

from __future__ import annotations

import io
import os
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import pydantic_core
import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from icrl_core.config import (
    AdaptConfig,
    BootstrapConfig,
    CodeConfig,
    DataConfig,
    DPOConfig,
    EvalConfig,
    EvaluateConfig,
    ModelConfig,
    PPOConfig,
    RewardModelConfig,
    Section,
    TokenizeConfig,
)
from icrl_core.critic_config import CriticConfig, CriticDistillConfig
from icrl_core.errors import ConfigError
from icrl_core.inference.config import InferenceConfig
from icrl_core.io import read_user_text

ENV_PREFIX = "ICRL_"
ENV_NESTED_DELIMITER = "__"


# --------------------------------------------------------------------------------------------------------------
# Orchestration


class TrackingConfig(Section):
    enabled: Annotated[bool, Field(description="Log params, metrics and artifacts to MLflow.")] = True
    tracking_uri: Annotated[str | None, Field(description="MLflow tracking URI. Default: sqlite:///mlflow.db "
                                              "in the working directory, artifacts in ./mlartifacts.")] = None
    experiment: Annotated[str, Field(description="MLflow experiment name.")] = "icrl"
    registered_model: Annotated[str, Field(description="MLflow registered model name of the trained "
                                           "policy.")] = "icrl-policy"


# The stages that train through tasks.runtime.launch (in-process or as a Ray Train job).
TrainingStage = Literal["bootstrap", "reward_model", "ppo", "dpo", "critic", "critic_distill", "adapt"]


class RayConfig(Section):
    address: Annotated[str | None, Field(description="Ray cluster address; empty = start a local Ray on "
                                         "127.0.0.1.")] = None
    num_workers: Annotated[int, Field(ge=1, description="Ray Train workers (DDP: NCCL on GPUs, gloo on CPUs).")] = 1
    num_cpus: Annotated[int, Field(ge=1, description="CPUs given to a local Ray.")] = 2
    cpus_per_worker: Annotated[int | None, Field(ge=1, description="CPUs each Ray Train worker asks for; Ray sets "
                                                 "the worker's OMP_NUM_THREADS (torch's threads) to it. Empty: a "
                                                 "local Ray's num_cpus shared among the workers (less the PPO "
                                                 "rollout actors' CPUs); 1 on a cluster (ray.address), whose size "
                                                 "the driver does not know.")] = None
    use_gpu: Annotated[Literal["auto"] | bool, Field(description="One GPU per Ray Train worker ('auto': when the "
                                                     "cluster has GPUs and model.device is not cpu). Workers then "
                                                     "train on CUDA with NCCL, else on CPUs with gloo.")] = "auto"
    ship_code: Annotated[Literal["auto"] | bool, Field(description="Ship icrl_core, tasks and flows to the Ray "
                                                       "workers (runtime_env py_modules), so a cluster needs no "
                                                       "copy of the project at the driver's path. 'auto': when "
                                                       "ray.address is set; a local Ray imports from the "
                                                       "driver's path.")] = "auto"
    max_failures: Annotated[int, Field(ge=0, description="Worker failures a Ray Train job survives by "
                                       "restarting from its last checkpoint.")] = 2
    enabled: Annotated[bool, Field(description="Run training stages as Ray Train jobs (off: in-process).")] = False
    stages: Annotated[list[TrainingStage] | None, Field(description="With ray.enabled, the training stages that "
                                                         "run as Ray Train jobs, the others in-process. Unset "
                                                         "(null): all of them.")] = None
    worker_niceness: Annotated[int, Field(ge=0, le=19, description="Niceness of a local Ray's worker processes. "
                                          "Ray's own default, 15, makes training jobs starve behind any other "
                                          "CPU job on a small shared machine; 0 runs them like the driver.")] = 0


class PrefectConfig(Section):
    work_pool: Annotated[str, Field(description="Prefect process work pool name.")] = "icrl-process"
    task_retries: Annotated[int, Field(ge=0, description="Retries of a failed stage task.")] = 1
    retry_delay_seconds: Annotated[int, Field(ge=0, description="Delay before a retry.")] = 5


class LogUniform(Section):
    kind: Literal["loguniform"] = "loguniform"
    low: Annotated[float, Field(gt=0)]
    high: Annotated[float, Field(gt=0)]


class Uniform(Section):
    kind: Literal["uniform"] = "uniform"
    low: float
    high: float


class Choice(Section):
    kind: Literal["choice"] = "choice"
    values: Annotated[list[Any], Field(min_length=1)]


SearchDomain = Annotated[LogUniform | Uniform | Choice, Field(discriminator="kind")]


class SweepConfig(Section):
    stage: Annotated[Literal["ppo", "bootstrap", "reward_model"], Field(description="Stage whose parameters are "
                                                                          "swept.")] = "ppo"
    search_space: Annotated[
        dict[str, SearchDomain],
        Field(description="Dotted config key -> distribution, e.g. ppo.learning_rate: {kind: loguniform, "
              "low: 1e-5, high: 1e-4}."),
    ] = Field(
        default_factory=lambda: {
            "ppo.learning_rate": LogUniform(low=1e-5, high=1e-4),
            "ppo.kl_beta": Choice(values=[0.01, 0.05]),
        }
    )
    num_samples: Annotated[int, Field(ge=1, description="Trials.")] = 4
    max_concurrent: Annotated[int, Field(ge=1, description="Trials running at once (2 cores: 2).")] = 2
    metric: Annotated[str, Field(description="Metric the scheduler optimises.")] = "mean_reward"
    mode: Annotated[Literal["max", "min"], Field(description="Maximise or minimise the metric.")] = "max"
    grace_period: Annotated[int, Field(ge=1, description="ASHA: reports before a trial may be stopped.")] = 2
    max_steps: Annotated[int, Field(ge=1, description="Steps per trial (overrides the stage's max_steps).")] = 6


# --------------------------------------------------------------------------------------------------------------


class PipelineConfig(Section):
    """The whole pipeline: one section per stage plus orchestration."""

    seed: Annotated[int, Field(description="Global seed (data order, init, sampling).")] = 0
    policy_optimization: Annotated[Literal["ppo", "dpo"], Field(
        description="What trains the policy after the bootstrap in a pipeline run: ppo (stages reward_model and "
                    "ppo, then adapt) or dpo (stage dpo). The other branch's stages are skipped; "
                    "evaluate.adapter names the evaluated adapter (artifacts/ppo/adapter or "
                    "artifacts/dpo/adapter, or the bootstrap's) and must not be the skipped branch's.")] = "ppo"
    critic_in_pipeline: Annotated[bool, Field(
        description="Run the in-context critic's stages (critic_data, critic, critic_distill; docs/CRITIC.md) in a "
                    "pipeline run (off: on demand, `icrl stage NAME` or `dvc repro critic_distill`). A top-level key, "
                    "not under `critic`, so that switching it reruns no stage in DVC.")] = False
    artifacts_dir: Annotated[Path, Field(description="Root of stage outputs.")] = Path("artifacts")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    tokenize: TokenizeConfig = Field(default_factory=TokenizeConfig)
    bootstrap: BootstrapConfig = Field(default_factory=BootstrapConfig)
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    adapt: AdaptConfig = Field(default_factory=AdaptConfig)
    icrl_eval: EvalConfig = Field(default_factory=EvalConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    code: CodeConfig = Field(default_factory=CodeConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig, description="The in-context critic (stages "
                                 "critic_data and critic; docs/CRITIC.md).")
    critic_distill: CriticDistillConfig = Field(default_factory=CriticDistillConfig, description="The "
                                                "critic_distill stage: the critic's Q-weighted policy distilled into "
                                                "the policy, or rejection fine-tuning (docs/CRITIC.md).")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    prefect: PrefectConfig = Field(default_factory=PrefectConfig)
    sweep: SweepConfig = Field(default_factory=SweepConfig)

    @model_validator(mode="after")
    def _evaluated_adapter_is_trained(self) -> PipelineConfig:
        """The evaluated adapter cannot come from a stage the chosen policy optimization skips."""
        skipped = {"ppo": (self.dpo.output_dir,), "dpo": (self.ppo.output_dir, self.reward_model.output_dir)}
        trained = {"ppo": self.ppo.output_dir, "dpo": self.dpo.output_dir}[self.policy_optimization]
        adapter = Path(self.evaluate.adapter)
        for folder in skipped[self.policy_optimization]:
            if adapter == Path(folder) or Path(folder) in adapter.parents:
                raise ValueError(f"evaluate.adapter {adapter} is an output of a stage that policy_optimization="
                                 f"{self.policy_optimization} skips; point it at {Path(trained) / 'adapter'}")
        return self


# --------------------------------------------------------------------------------------------------------------
# Layers: where values come from. Defaults, then config files in order (later wins), then the ICRL_* environment,
# then command-line options (e.g. `icrl eval --task`) and Prefect parameters, then --set.


@dataclass(frozen=True)
class Layer:
    """One source of config values, merged over the ones before it. `source` names it in `icrl config show
    --origin` and in errors (a file path, `environment`, `--set`); `keys` names a finer source per dotted key
    (the environment variable, the --set item)."""

    source: str
    tree: dict
    keys: Mapping[str, str] = dataclass_field(default_factory=dict)

    def source_of(self, dotted: str) -> str:
        parts = dotted.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in self.keys:
                return self.keys[".".join(parts[:end])]
        inside = [source for key, source in self.keys.items() if key.startswith(dotted + ".")]
        return ", ".join(inside) or self.source


def parse_value(text: str) -> Any:
    """Parse an override value as YAML, so `0.02`, `true`, `[a, b]` and `{kind: adaptive}` all work."""
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def parse_assignment(item: str) -> tuple[str, Any]:
    """`ppo.kl_beta=0.02` -> ("ppo.kl_beta", 0.02): the one parser of `--set KEY=VALUE`."""
    key, sep, raw = item.partition("=")
    if not sep:
        raise ConfigError(f"--set expects KEY=VALUE (e.g. ppo.kl_beta=0.02), got {item!r}")
    return key.strip(), parse_value(raw)


def split_key(dotted: str, path: str = "") -> list[str]:
    """`ppo.kl_beta` -> [ppo, kl_beta]. The keys of a mapping-valued field are data, kept whole:
    `sweep.search_space.ppo.kl_beta` -> [sweep, search_space, ppo.kl_beta]. `path`: where `dotted` sits."""
    parts = dotted.split(".")
    for end in range(1, len(parts)):
        if _join(path, ".".join(parts[:end])) in _MAPPING_FIELDS:
            return parts[:end] + [".".join(parts[end:])]
    return parts


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """Set `tree['a']['b'] = value` for `dotted == 'a.b'`, creating dicts on the way."""
    parts = split_key(dotted)
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def deep_merge(base: dict, update: Mapping, path: str = "",
               on_replace: Callable[[str, Any], None] | None = None) -> dict:
    """Merge `update` into a copy of `base`; nested sections merge, everything else is replaced.

    A dict that changes the `kind` of a discriminated section replaces the section instead of merging into it,
    so `--set ppo.kl_control.kind=adaptive` does not keep keys of the old variant; a mapping-valued field
    (e.g. sweep.search_space) is replaced as a whole. `on_replace(dotted key, value)` is called for every value
    that replaces what was there (origin tracking)."""
    out = dict(base)
    for key, value in update.items():
        old = out.get(key)
        where = _join(path, str(key))
        same_kind = isinstance(old, dict) and isinstance(value, Mapping) and old.get(
            "kind", value.get("kind")) == value.get("kind", old.get("kind"))
        if same_kind and where not in _MAPPING_FIELDS:
            out[key] = deep_merge(old, value, where, on_replace)
        else:
            out[key] = dict(value) if isinstance(value, Mapping) else value
            if on_replace is not None:
                on_replace(where, value)
    return out


def expand_dotted(node: Mapping, path: str = "") -> dict:
    """A config file's mapping -> nested tree: `{"ppo.kl_beta": 0.02, "ppo": {"epochs": 2}}` ->
    `{"ppo": {"kl_beta": 0.02, "epochs": 2}}`, so a file may hold sections, dotted keys or both."""
    tree: dict = {}
    for key, value in node.items():
        if not isinstance(key, str):
            raise ConfigError(f"{_join(path, str(key))}: keys must be text (section or dotted key names), "
                              f"got {key!r}")
        parts = split_key(key, path)
        where = _join(path, ".".join(parts))
        if isinstance(value, Mapping) and where not in _MAPPING_FIELDS:
            value = expand_dotted(value, where)
        for part in reversed(parts):
            value = {part: value}
        tree = deep_merge(tree, value, path)
    return tree


def read_config_file(path: Path | str) -> dict:
    """A config file (params.yaml, an experiment): a YAML mapping of sections (`ppo: {kl_beta: 0.02}`) and/or
    dotted keys (`ppo.kl_beta: 0.02`) -> nested tree. Any problem is a ConfigError that names the file."""
    path = Path(path)
    text = read_user_text(path, "YAML config file", error=ConfigError)
    stream = io.StringIO(text)
    stream.name = str(path)  # YAML errors then say `in "<path>", line L, column C`
    try:
        data = yaml.safe_load(stream)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections or dotted keys (e.g. "
                          f"ppo.kl_beta: 0.02), got {type(data).__name__}")
    try:
        return expand_dotted(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def file_layer(path: Path | str) -> Layer:
    return Layer(str(path), read_config_file(path))


def env_layer(environ: Mapping[str, str] | None = None) -> Layer:
    """`ICRL_PPO__KL_BETA=0.02` -> {"ppo": {"kl_beta": 0.02}}. Keys are lower-cased.

    A name without the `__` delimiter is a config key only if it names a top-level field (`ICRL_SEED`); other
    `ICRL_*` variables (ICRL_PROJECT_DIR, ICRL_MLFLOW_PARENT_RUN_ID, ...) belong to the process, not the config."""
    environ = os.environ if environ is None else environ
    tree: dict = {}
    keys: dict[str, str] = {}
    for name, raw in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        if (ENV_NESTED_DELIMITER not in name[len(ENV_PREFIX):]
                and name[len(ENV_PREFIX):].lower() not in PipelineConfig.model_fields):
            continue
        dotted = ".".join(part.lower() for part in name[len(ENV_PREFIX):].split(ENV_NESTED_DELIMITER))
        set_dotted(tree, dotted, parse_value(raw))
        keys[dotted] = name
    return Layer("environment", tree, keys)


def env_overrides(environ: Mapping[str, str] | None = None) -> dict:
    return env_layer(environ).tree


def set_layer(assignments: Iterable[str]) -> Layer:
    """`["ppo.kl_beta=0.02", "seed=3"]` -> one layer; each key remembers its --set item."""
    tree: dict = {}
    keys: dict[str, str] = {}
    for item in assignments:
        key, value = parse_assignment(item)
        set_dotted(tree, key, value)
        keys[key] = f"--set {item}"
    return Layer("--set", tree, keys)


def config_layers(files: Iterable[Path | str] = (), overrides: Iterable[str] = (),
                  environ: Mapping[str, str] | None = None, extra: Mapping | None = None,
                  extra_source: str = "command-line option") -> list[Layer]:
    """The layers in precedence order: files (later wins) < environment < `extra` < `--set`."""
    layers = [file_layer(path) for path in files]
    layers.append(env_layer(environ))
    if extra:
        layers.append(Layer(extra_source, dict(extra)))
    layers.append(set_layer(overrides))
    return layers


def merge_layers(layers: Iterable[Layer]) -> tuple[dict, dict[str, str]]:
    """The defaults with each layer merged over the ones before it: the raw tree, and the source of every leaf
    a layer set (dotted key -> source; a key not in it has its default)."""
    tree: dict = PipelineConfig().model_dump(mode="json")
    origins: dict[str, str] = {}
    for layer in layers:
        def replaced(where: str, value: Any, layer: Layer = layer) -> None:
            for key in [k for k in origins if k == where or k.startswith(where + ".")]:
                del origins[key]  # e.g. a section whose kind changed: its old keys are gone
            for leaf in _leaves(value, where):
                origins[leaf] = layer.source_of(leaf)

        tree = deep_merge(tree, layer.tree, on_replace=replaced)
    return tree, origins


@dataclass(frozen=True)
class Resolved:
    """A validated config and where each of its values came from."""

    config: PipelineConfig
    origins: Mapping[str, str]

    def origin_lines(self) -> str:
        """`key: value  # source` for every leaf, in schema order: the output of `icrl config show --origin`
        (itself a valid config file of dotted keys)."""
        rows = [(key, _flow_yaml(value), self.origins.get(key, "default"))
                for key, value in _leaf_values(self.config.model_dump(mode="json"))]
        width = min(max(len(f"{key}: {shown}") for key, shown, _ in rows), 72)
        return "".join(f"{f'{key}: {shown}':<{width}}  # {source}\n" for key, shown, source in rows)


def resolve(files: Iterable[Path | str] = (), overrides: Iterable[str] = (),
            environ: Mapping[str, str] | None = None, extra: Mapping | None = None) -> Resolved:
    """Resolve the config from its layers (see config_layers); errors name the layer a bad value came from."""
    tree, origins = merge_layers(config_layers(files, overrides, environ, extra))
    return Resolved(validate_config(tree, origins), origins)


def load_config(
    params_file: Path | str | Iterable[Path | str] | None = None,
    overrides: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
    extra: Mapping | None = None,
) -> PipelineConfig:
    """Resolve the config: defaults < params file(s), in order < environment < `extra` (e.g. Prefect parameters
    or command options) < `--set`."""
    if params_file is None:
        files: list = []
    elif isinstance(params_file, (str, Path)):
        files = [params_file]
    else:
        files = list(params_file)
    return resolve(files, overrides, environ, extra).config


def validate_config(tree: Mapping, origins: Mapping[str, str] | None = None) -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, origins)) from None


def with_overrides(config: PipelineConfig, overrides: Mapping[str, Any]) -> PipelineConfig:
    """A copy of `config` with dotted-key overrides applied (used by sweeps and flows). A `kind` key is applied
    before its section's other keys: it replaces the section (`deep_merge`), which would drop them."""
    tree = config.model_dump(mode="json")
    kinds_first = sorted(overrides.items(), key=lambda item: not str(item[0]).endswith(".kind"))
    for dotted, value in kinds_first:
        flat: dict = {}
        set_dotted(flat, dotted, value)
        tree = deep_merge(tree, flat)
    return validate_config(tree)


def config_diff(old: PipelineConfig, new: PipelineConfig) -> dict[str, Any]:
    """Dotted keys whose values differ from `old` to `new`: what `--set` (or `dvc exp run -S`) would have to write
    to turn one into the other. A section whose kind changed, a list and a mapping-valued field count as one
    value each."""
    changed: dict[str, Any] = {}

    def walk(before: Any, after: Any, path: str) -> None:
        if (isinstance(before, dict) and isinstance(after, dict) and path not in _MAPPING_FIELDS
                and before.get("kind") == after.get("kind")):
            for key, value in after.items():
                walk(before.get(key), value, _join(path, key))
        elif before != after:
            changed[path] = after

    walk(old.model_dump(mode="json"), new.model_dump(mode="json"), "")
    return changed


def params_file_overrides(params_file: Path | str, files: Iterable[Path | str],
                          overrides: Iterable[str] = ()) -> dict[str, Any]:
    """Dotted keys to write into `params_file` so that it alone resolves like the layered `files` + `--set`
    (what DVC must see: the stages read params_file). Empty when the layers add nothing to params_file. The
    environment is left out: it reaches the stages by itself."""
    current = load_config([params_file] if Path(params_file).exists() else [], [], environ={})
    return config_diff(current, load_config(list(files), overrides, environ={}))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _leaves(value: Any, path: str) -> Iterable[str]:
    """Dotted keys of the leaves under `value` at `path`; a list, an empty mapping and a mapping-valued field
    are one leaf each."""
    if isinstance(value, Mapping) and value and path not in _MAPPING_FIELDS:
        for key, child in value.items():
            yield from _leaves(child, _join(path, str(key)))
    else:
        yield path


def _leaf_values(tree: Mapping) -> list[tuple[str, Any]]:
    found = []
    for key in _leaves(tree, ""):
        node: Any = tree
        for part in split_key(key):
            node = node[part]
        found.append((key, node))
    return found


def _flow_yaml(value: Any) -> str:
    """One-line YAML of a value, as in the docs and `config show --origin`."""
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


# Keys that were renamed: an old params.yaml gets told the new name instead of only "unknown key".
RENAMED = {"evaluate.reuse_base_runs": "evaluate.reuse_runs"}


def format_validation_error(exc: ValidationError, origins: Mapping[str, str] | None = None) -> str:
    """One line per error: the dotted key, what is wrong, and which layer (file, variable, --set) set it."""
    lines = ["invalid configuration:"]
    for err in exc.errors():
        loc = tuple(err["loc"])
        # drop discriminator tags (e.g. 'lora') from the printed key
        # (a tag is never the first part: the top level holds sections, and `ppo` is both a section and a tag)
        key = ".".join(str(p) for i, p in enumerate(loc) if not (i and isinstance(p, str) and p in _TAGS))
        if err["type"] == "extra_forbidden" and key in RENAMED:
            lines.append(f"  {key}: renamed to {RENAMED[key]}")
        elif err["type"] == "extra_forbidden":
            holder = _holder_of(loc)
            allowed = ", ".join(sorted(holder.model_fields)) if holder else "?"
            lines.append(f"  {key}: unknown key; allowed keys here: {allowed}")
        elif err["type"] in ("literal_error", "enum"):
            lines.append(f"  {key}: {err['msg']} (got {err.get('input')!r})")
        elif err["type"] == "union_tag_invalid":
            lines.append(f"  {key}: {err['msg']}")
        elif err["type"] == "value_error":  # a validator's own message (the input is the whole section)
            lines.append(f"  {key}: {err['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"  {key}: {err['msg']} (got {err.get('input')!r})")
        source = _source_of(key, origins or {})
        if source:
            lines[-1] += f" [from {source}]"
    return "\n".join(lines)


def _source_of(key: str, origins: Mapping[str, str]) -> str | None:
    """The layer that set `key` or the nearest enclosing key (a list, a replaced section)."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in origins:
            return origins[".".join(parts[:end])]
    return None


def _all_tags(model: type[BaseModel] | None = None, seen: set | None = None) -> set[str]:
    """The `kind` values of every variant of every discriminated section (found by walking the schema)."""
    model = model or PipelineConfig
    seen = set() if seen is None else seen
    if model in seen:
        return set()
    seen.add(model)
    tags = set()
    kind = model.model_fields.get("kind")
    if kind is not None and isinstance(kind.default, str):
        tags.add(kind.default)
    for field in model.model_fields.values():
        found = _variants(field.annotation)
        for sub in found if isinstance(found, list) else [found] if found else []:
            tags |= _all_tags(sub, seen)
    return tags



def _mapping_fields(model: type[BaseModel] | None = None, prefix: str = "") -> set[str]:
    """Dotted paths of dict-typed fields (replaced, not merged, by overrides)."""
    model = model or PipelineConfig
    found = set()
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if get_origin(annotation) is Annotated:
            annotation = get_args(annotation)[0]
        if get_origin(annotation) is dict:
            found.add(prefix + name)
        elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found |= _mapping_fields(annotation, f"{prefix}{name}.")
    return found


_MAPPING_FIELDS = _mapping_fields()


def _holder_of(loc: tuple) -> type[BaseModel] | None:
    """The model whose fields are allowed where an unknown key `loc[-1]` was found, tags included."""
    model: Any = PipelineConfig
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if isinstance(part, str) and part in _TAGS and isinstance(model, list):
            model = next(m for m in model if m.model_fields["kind"].default == part)
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        field = model.model_fields.get(part)
        if field is None:
            return None
        model = _variants(field.annotation)
    if isinstance(model, list):
        return model[0] if len(model) == 1 else None
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _variants(annotation: Any) -> Any:
    """A model class, or the list of model classes of a union, found in a field annotation."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _variants(get_args(annotation)[0])
    if origin in (list, dict):
        return _variants(get_args(annotation)[-1])
    if origin is Union or origin is types.UnionType:
        found = [a for a in (_variants(x) for x in get_args(annotation)) if a is not None]
        flat = []
        for item in found:
            flat.extend(item if isinstance(item, list) else [item])
        return flat[0] if len(flat) == 1 else (flat or None)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


_TAGS = _all_tags()


def config_to_flat_params(config: PipelineConfig) -> dict[str, str]:
    """Flatten to dotted keys with string values (MLflow params). No secrets live in the config; URIs with
    credentials are redacted anyway."""
    flat: dict[str, str] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = redact(str(node))

    walk("", config.model_dump(mode="json"))
    return flat


def redact(text: str) -> str:
    """Hide the password of a URI like scheme://user:password@host."""
    import re

    return re.sub(r"(://[^:/@\s]+:)[^@\s]+@", r"\1***@", text)


def describe_fields(model: type[BaseModel] = PipelineConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, description) for every leaf field: the source of the params reference docs."""
    rows: list[tuple[str, str, str]] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        sub = _variants(field.annotation)
        if isinstance(sub, type) and issubclass(sub, BaseModel) and get_origin(field.annotation) not in (list, dict):
            rows.extend(describe_fields(sub, key + "."))
            continue
        default = pydantic_core.to_jsonable_python(field.get_default(call_default_factory=True))
        rows.append((key, _flow_yaml(default), field.description or ""))
    return rows


CONFIG_DOC_INTRO = """\
# Configuration

Generated from the schema by `icrl config docs --output docs/CONFIG.md` (algorithm and stage sections:
`icrl_core/config.py`; orchestration sections and the loader: `tasks/settings.py`).

Every command that reads the config resolves it from layers, later wins:

1. the defaults below;
2. config files in the order given: `-c FILE` (alias `--params`; `@FILE` for short), repeatable, default
   `./params.yaml`. A file holds sections (`ppo: {kl_beta: 0.02}`), dotted keys (`ppo.kl_beta: 0.02`) or both;
3. environment variables `ICRL_SECTION__KEY=value` (e.g. `ICRL_PPO__KL_BETA=0.02`);
4. command options (e.g. `icrl eval --task`) and Prefect deployment parameters;
5. `--set section.key=value`, repeatable (values are YAML).

A mapping that changes a section's `kind` replaces the section; lists and mapping-valued keys
(`sweep.search_space`, `evaluate.temperatures`) are replaced whole. `icrl config show --origin` prints every value
with the file, variable or `--set` item it came from (or `default`); an error names the layer of the bad value.
The DVC stages read `params.yaml`, so `icrl pipeline` first writes into it the keys whose values its layers
change. Small configs for debugging, layered on params.yaml: `experiments/debug/`
(`icrl pipeline -c params.yaml -c experiments/debug/tiny.yaml`).

"""


def config_reference() -> str:
    """docs/CONFIG.md: how the config is resolved, then every key with its default and description (Markdown),
    from the schema."""
    lines = [CONFIG_DOC_INTRO + "| key | default | description |", "|---|---|---|"]
    for key, default, description in describe_fields():
        lines.append(f"| `{key}` | `{default}` | {description.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
