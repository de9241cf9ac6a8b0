"""Can this model learn the hindsight-couple contrast at all? A learnability check (PREREGISTERED.md, addendum 6).

Settings 4 and 5 trained on hindsight couples of fresh streams every step and the couples' contrast did not move.
This check removes the fresh data: ONE fixed set of training couples (rolled out once by the start adapter) is
trained on for `--steps` steps at each learning rate, from the same start each time, with the `dpo` section's loss
(`dpo.hindsight_loss`), batch size and gradient clipping. Every `--eval-every` steps it measures, on those training
couples and on the validation streams' couples (also fixed): the mean contrast m = margin(real world) +
margin(renamed world) per couple (0 for a feedback-blind policy), the share of couples with m > 0, and the couple
accuracy (both pairs preferred; 0 for a blind policy).

Read: m rising on the training couples says the contrast is learnable by this adapter at that learning rate (the
gradient reaches what the feedback changes); no rise even there says something blocks it (capacity, learning rate,
the signal). The validation couples say whether what is learned carries to new streams of the training tasks.
Not a recipe: nothing here is evaluated on trec_coarse.

    python experiments/icrl_stream_rl/couple_learnability.py -c params.yaml -c experiments/icrl_skill.yaml \\
        -c experiments/icrl_stream_rl/h32_ppo.yaml \\
        -c experiments/icrl_stream_rl/hindsight_dpo.yaml -c experiments/icrl_stream_rl/hindsight_contrast.yaml \\
        --adapter artifacts/bootstrap/adapter --output experiments/icrl_stream_rl/learnability.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def measure(policy, couples, cfg) -> dict[str, float]:
    """Contrast statistics of `couples` under the current weights (no gradient)."""
    import torch

    from icrl_core.dpo import couple_micro_steps

    policy.eval()
    with torch.no_grad():
        out = couple_micro_steps(policy, couples, cfg, 1, 1.0, backward=False)
    pairs = max(out["hindsight_pairs"], 1.0)
    result = {"couples": couples.couples, "loss": out["loss"] / pairs,
              "pair_accuracy": out["hindsight_policy_accuracy"] / pairs,
              "couple_accuracy": 2 * out["hindsight_couple_accuracy"] / pairs}
    if cfg.hindsight_loss == "contrast":  # margin sums 2 beta m per couple, accuracy 2 per couple with m > 0
        result["mean_contrast_m"] = out["margin"] / (cfg.beta * pairs)
        result["share_m_positive"] = out["accuracy"] / pairs
    else:
        result["mean_beta_h"] = out["margin"] / pairs
        result["share_h_positive"] = out["accuracy"] / pairs
    return {k: round(v, 5) if isinstance(v, float) else v for k, v in result.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", action="append", required=True, help="config files, in order")
    parser.add_argument("--adapter", required=True, help="the start adapter (the bootstrap's)")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--learning-rates", type=float, nargs="+", default=[2e-4, 2e-3])
    parser.add_argument("--train-groups", type=int, default=2, help="stream groups of the fixed training couples")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()

    import torch

    from icrl_core.dataset_build import resolve_sources
    from icrl_core.dpo import couple_micro_steps, rolled_streams, stream_couples
    from icrl_core.io import atomic_write_json
    from icrl_core.model import policy_from_config
    from tasks.settings import load_config

    torch.set_num_threads(args.threads)
    config = load_config(args.config, environ={})
    cfg, seed = config.dpo, config.seed
    sources, data = resolve_sources(config.data, seed), config.data
    policy = policy_from_config(config.model, seed=seed, init_adapter=Path(args.adapter))
    start = {name: tensor.clone() for name, tensor in policy.trainable_state_dict().items()}
    max_tokens = min(config.data.episode_tokens, policy.context_window)
    began = time.perf_counter()
    train = stream_couples(policy, rolled_streams(policy, sources, data, cfg, seed, 1, range(args.train_groups),
                                                  "train", max_tokens), seed, 1)
    val = stream_couples(policy, rolled_streams(policy, sources, data, cfg, seed, 0, range(cfg.stream.eval_groups),
                                                "val", max_tokens), seed, 0)
    result = {"configs": args.config, "adapter": args.adapter, "loss": cfg.hindsight_loss, "beta": cfg.beta,
              "max_grad_norm": cfg.max_grad_norm, "batch_size": cfg.batch_size, "train_groups": args.train_groups,
              "group_size": cfg.stream.group_size, "stream_steps": cfg.stream.steps, "steps": args.steps,
              "train_couples": train.couples, "val_couples": val.couples,
              "rollout_seconds": round(time.perf_counter() - began, 1), "runs": []}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}), flush=True)
    for lr in args.learning_rates:
        policy.load_trainable_state_dict(start, "checkpoint")
        params = policy.trainable_parameters()
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay)
        run = {"learning_rate": lr, "history": []}
        began = time.perf_counter()
        for step in range(args.steps + 1):
            if step % args.eval_every == 0:
                row = {"step": step, "train": measure(policy, train, cfg), "val": measure(policy, val, cfg)}
                run["history"].append(row)
                print(json.dumps({"lr": lr, **row}), flush=True)
            if step == args.steps:
                break
            policy.train()
            optimizer.zero_grad(set_to_none=True)
            out = couple_micro_steps(policy, train, cfg, train.pairs, 1.0)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
            optimizer.step()
            run["history"].append({"step": step + 1, "train_loss": round(out["loss"], 5),
                                   "grad_norm": round(grad_norm, 4)})
        run["seconds"] = round(time.perf_counter() - began, 1)
        result["runs"].append(run)
        atomic_write_json(args.output, result)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
