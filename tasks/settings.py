"""The whole pipeline config and its loader.

`PipelineConfig` hangs the algorithm and stage sections of `icrl_core/config.py` together with the orchestration
sections (tracking, Ray, Prefect, sweeps). The same pydantic models serve `params.yaml`, environment overrides
(`ICRL_PPO__KL_BETA=0.02`), CLI overrides (`--set ppo.kl_beta=0.02`), Prefect deployment parameters and Ray Tune
search spaces. Each field carries its own description and bounds, so `--help`, the generated docs and validation
all come from here.

Precedence: CLI `--set` > environment `ICRL_*` > `params.yaml` > defaults.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import pydantic_core
import yaml
from pydantic import BaseModel, Field, ValidationError

from icrl_core.config import (AdaptConfig, AdaptiveKL, BootstrapConfig, DataConfig, EvalConfig, EvaluateConfig,
                              FileSource, FixedKL, FrozenAdapter, LastBlocksAdapter, LoraAdapter, MixedReward,
                              ModelConfig, ModelReward, PPOConfig, RewardModelConfig, Section, SyntheticSource,
                              TaskReward, TaskSource, TokenizeConfig)
from icrl_core.errors import ConfigError

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


class RayConfig(Section):
    address: Annotated[str | None, Field(description="Ray cluster address; empty = start a local Ray on "
                                         "127.0.0.1.")] = None
    num_workers: Annotated[int, Field(ge=1, description="Ray Train workers (DDP with gloo on CPU).")] = 1
    num_cpus: Annotated[int, Field(ge=1, description="CPUs given to a local Ray.")] = 2
    use_gpu: Annotated[Literal["auto"] | bool, Field(description="Use GPUs in Ray Train ('auto': if "
                                                     "available).")] = "auto"
    max_failures: Annotated[int, Field(ge=0, description="Worker failures a Ray Train job survives by "
                                       "restarting from its last checkpoint.")] = 2
    enabled: Annotated[bool, Field(description="Run training stages as Ray Train jobs (off: in-process).")] = False
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


SearchDomain = Annotated[Union[LogUniform, Uniform, Choice], Field(discriminator="kind")]


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
    artifacts_dir: Annotated[Path, Field(description="Root of stage outputs.")] = Path("artifacts")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    tokenize: TokenizeConfig = Field(default_factory=TokenizeConfig)
    bootstrap: BootstrapConfig = Field(default_factory=BootstrapConfig)
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    adapt: AdaptConfig = Field(default_factory=AdaptConfig)
    icrl_eval: EvalConfig = Field(default_factory=EvalConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    prefect: PrefectConfig = Field(default_factory=PrefectConfig)
    sweep: SweepConfig = Field(default_factory=SweepConfig)


# --------------------------------------------------------------------------------------------------------------
# Loading and overrides


def parse_value(text: str) -> Any:
    """Parse an override value as YAML, so `0.02`, `true`, `[a, b]` and `{kind: adaptive}` all work."""
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """Set `tree['a']['b'] = value` for `dotted == 'a.b'`, creating dicts on the way."""
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def deep_merge(base: dict, update: Mapping, path: str = "") -> dict:
    """Merge `update` into a copy of `base`; nested sections merge, everything else is replaced.

    A dict that changes the `kind` of a discriminated section replaces the section instead of merging into it,
    so `--set ppo.kl_control.kind=adaptive` does not keep keys of the old variant; a mapping-valued field
    (e.g. sweep.search_space) is replaced as a whole."""
    out = dict(base)
    for key, value in update.items():
        old = out.get(key)
        where = f"{path}.{key}" if path else str(key)
        same_kind = isinstance(old, dict) and isinstance(value, Mapping) and old.get(
            "kind", value.get("kind")) == value.get("kind", old.get("kind"))
        if same_kind and where not in _MAPPING_FIELDS:
            out[key] = deep_merge(old, value, where)
        else:
            out[key] = dict(value) if isinstance(value, Mapping) else value
    return out


def env_overrides(environ: Mapping[str, str] | None = None) -> dict:
    """`ICRL_PPO__KL_BETA=0.02` -> {"ppo": {"kl_beta": 0.02}}. Keys are lower-cased.

    A name without the `__` delimiter is a config key only if it names a top-level field (`ICRL_SEED`); other
    `ICRL_*` variables (ICRL_PROJECT_DIR, ICRL_MLFLOW_PARENT_RUN_ID, ...) belong to the process, not the config."""
    environ = os.environ if environ is None else environ
    tree: dict = {}
    for name, raw in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        if (ENV_NESTED_DELIMITER not in name[len(ENV_PREFIX):]
                and name[len(ENV_PREFIX):].lower() not in PipelineConfig.model_fields):
            continue
        dotted = ".".join(part.lower() for part in name[len(ENV_PREFIX):].split(ENV_NESTED_DELIMITER))
        set_dotted(tree, dotted, parse_value(raw))
    return tree


def cli_overrides(assignments: Iterable[str]) -> dict:
    """`["ppo.kl_beta=0.02", "seed=3"]` -> nested dict."""
    tree: dict = {}
    for item in assignments:
        if "=" not in item:
            raise ConfigError(f"--set expects KEY=VALUE (e.g. ppo.kl_beta=0.02), got {item!r}")
        key, raw = item.split("=", 1)
        set_dotted(tree, key.strip(), parse_value(raw))
    return tree


def read_params_file(path: Path) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path}: params file not found") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def load_config(
    params_file: Path | str | None = None,
    overrides: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
    extra: Mapping | None = None,
) -> PipelineConfig:
    """Resolve the config: defaults < params file < environment < `extra` (e.g. Prefect parameters) < `--set`."""
    tree: dict = PipelineConfig().model_dump(mode="json")
    if params_file is not None:
        tree = deep_merge(tree, read_params_file(Path(params_file)))
    tree = deep_merge(tree, env_overrides(environ))
    if extra:
        tree = deep_merge(tree, extra)
    tree = deep_merge(tree, cli_overrides(overrides))
    return validate_config(tree)


def validate_config(tree: Mapping) -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def with_overrides(config: PipelineConfig, overrides: Mapping[str, Any]) -> PipelineConfig:
    """A copy of `config` with dotted-key overrides applied (used by sweeps and flows)."""
    tree = config.model_dump(mode="json")
    for dotted, value in overrides.items():
        flat: dict = {}
        set_dotted(flat, dotted, value)
        tree = deep_merge(tree, flat)
    return validate_config(tree)


# Keys that were renamed: an old params.yaml gets told the new name instead of only "unknown key".
RENAMED = {"evaluate.reuse_base_runs": "evaluate.reuse_runs"}


def format_validation_error(exc: ValidationError) -> str:
    lines = ["invalid configuration:"]
    for err in exc.errors():
        loc = tuple(err["loc"])
        # drop discriminator tags (e.g. 'lora') from the printed key
        key = ".".join(str(p) for p in loc if not (isinstance(p, str) and p in _TAGS))
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
        else:
            lines.append(f"  {key}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)


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



def _mapping_fields(model: type[BaseModel] = None, prefix: str = "") -> set[str]:
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
    if origin is Union or str(origin) == "types.UnionType":
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
        shown = yaml.safe_dump(default, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()
        rows.append((key, shown, field.description or ""))
    return rows


def config_reference() -> str:
    """docs/CONFIG.md: every config key with its default and description (Markdown), from the schema."""
    lines = ["| key | default | description |", "|---|---|---|"]
    for key, default, description in describe_fields():
        lines.append(f"| `{key}` | `{default}` | {description.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
