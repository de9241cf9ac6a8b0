"""SmolLM2-135M-Instruct's pass@1 per difficulty level on a sample of the held-out code tasks (greedy).

Each task's prompt (signature + docstring) goes into one user turn asking for the whole function in a Python
code block; the completion's first code block is the program (icrl_core.code_reward.extract_code), scored in the
sandbox against the task's hidden tests. pass@1 = share of tasks whose program passes every test (greedy
decoding: one sample, so pass@1 is exact, not estimated). Generations are batched per level (left padding,
float32).

    .venv/bin/python experiments/code_tasks/pass_at_1.py            # -> experiments/code_tasks/pass_at_1.json
    .venv/bin/python experiments/code_tasks/pass_at_1.py --per-level 4 --model tiny
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from icrl_core.code_reward import CodeConfig, extract_code, score_many
from icrl_core.code_tasks import split_tasks
from icrl_core.io import atomic_write_json
from icrl_core.model import load_policy

INSTRUCTION = ("Complete this Python function. Reply with the whole function (signature, docstring and body) in "
               "a single ```python code block.\n\n```python\n{prompt}```")


@torch.no_grad()
def generate(policy, prompts: list[str], max_new_tokens: int) -> list[str]:
    tokenizer = policy.tokenizer
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": INSTRUCTION.format(prompt=p)}],
                                           add_generation_prompt=True, tokenize=False) for p in prompts]
    tokenizer.padding_side = "left"
    encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    output = policy.model.generate(**encoded, max_new_tokens=max_new_tokens, do_sample=False,
                                   pad_token_id=tokenizer.pad_token_id)
    return tokenizer.batch_decode(output[:, encoded["input_ids"].shape[1]:], skip_special_tokens=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--per-level", type=int, default=6, help="test tasks sampled per difficulty level")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a busy 2-core "
                        "machine)")
    parser.add_argument("--seed", type=int, default=0, help="which test tasks are sampled")
    parser.add_argument("--output", type=Path, default=Path(__file__).with_name("pass_at_1.json"))
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    policy = load_policy(args.model, dtype="float32")
    rng = random.Random(args.seed)
    tasks = split_tasks("test")
    levels: dict[str, dict] = {}
    rows = []
    started = time.perf_counter()
    for level in sorted({t.level for t in tasks}):
        sample = rng.sample([t for t in tasks if t.level == level], args.per_level)
        completions = generate(policy, [t.prompt for t in sample], args.max_new_tokens)
        programs = [extract_code(c, t) for c, t in zip(completions, sample)]
        breakdowns = score_many(programs, sample, CodeConfig())
        passed = [b.tests_passed == b.tests_total for b in breakdowns]
        levels[str(level)] = {"tasks": len(sample), "pass_at_1": sum(passed) / len(sample),
                              "mean_test_pass_fraction": sum(b.components["pass_fraction"] for b in breakdowns)
                              / len(sample), "mean_reward": sum(b.total for b in breakdowns) / len(sample)}
        for task, program, breakdown in zip(sample, programs, breakdowns):
            rows.append({"task_id": task.task_id, "level": level, "passed": breakdown.tests_passed,
                         "tests": breakdown.tests_total, "reward": round(breakdown.total, 4),
                         "reason": breakdown.reason, "program": program})
        print(f"level {level}: pass@1 {levels[str(level)]['pass_at_1']:.2f} "
              f"({sum(passed)}/{len(sample)}), mean test pass fraction "
              f"{levels[str(level)]['mean_test_pass_fraction']:.2f}")
    result = {"model": args.model, "dtype": "float32", "decoding": "greedy", "max_new_tokens": args.max_new_tokens,
              "seed": args.seed, "split": "test", "per_level": args.per_level, "levels": levels,
              "seconds": round(time.perf_counter() - started, 1), "isolation": breakdowns[0].isolation,
              "tasks": rows}
    atomic_write_json(args.output, result)
    print(f"wrote {args.output} ({result['seconds']} s)")


if __name__ == "__main__":
    main()
