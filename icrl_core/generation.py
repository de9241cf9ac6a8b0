"""Small generation helpers shared by the CLI, tests and stages."""

from __future__ import annotations

import torch


@torch.no_grad()
def greedy_chat_answer(policy, question: str, max_new_tokens: int = 48, system: str | None = None) -> str:
    """Greedy answer to one user turn, rendered with the model's own chat template."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    encoded = policy.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                   return_dict=True)
    encoded = {key: value.to(policy.device) for key, value in encoded.items()}
    output = policy.model.generate(**encoded, max_new_tokens=max_new_tokens, do_sample=False,
                                   pad_token_id=policy.tokenizer.pad_token_id)
    return policy.tokenizer.decode(output[0, encoded["input_ids"].shape[1]:], skip_special_tokens=True).strip()
