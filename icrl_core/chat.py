"""Chat rendering that is stable under concatenation.

In-context RL keeps a growing conversation and reuses the key/value cache of its prefix, so the token ids of a
conversation must be the concatenation of the token ids of its parts. `ChatFormat` reads a tokenizer's chat
template once (by rendering probe messages) and splits it into per-role prefix/suffix strings; `Conversation`
then tokenizes piece by piece. Training episodes and the evaluation harness use the same pieces, so what the
model is trained on is exactly what it is evaluated on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from icrl_core.errors import UserError

_S, _U, _A, _U2 = "\x01SYSTEM\x01", "\x01USER\x01", "\x01ASSISTANT\x01", "\x01USER2\x01"


@dataclass(frozen=True)
class ChatFormat:
    """Role delimiters of a chat template, e.g. ChatML: user_prefix='<|im_start|>user\\n', user_suffix='<|im_end|>\\n'."""

    system_prefix: str
    system_suffix: str
    user_prefix: str
    user_suffix: str
    assistant_prefix: str
    assistant_suffix: str
    supports_system: bool = True

    @classmethod
    def from_tokenizer(cls, tokenizer) -> ChatFormat:
        """Derive the delimiters by rendering probe conversations with the tokenizer's own template."""
        if not getattr(tokenizer, "chat_template", None):
            return PLAIN_FORMAT

        def render(messages, generation=False) -> str:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)

        system = [{"role": "system", "content": _S}]
        user = {"role": "user", "content": _U}
        assistant = {"role": "assistant", "content": _A}
        user2 = {"role": "user", "content": _U2}
        try:
            t_s = render(system)
            supports_system = _S in t_s
        except Exception:  # noqa: BLE001 - a template is arbitrary Jinja; any error: it rejects system messages
            supports_system = False
        if not supports_system:
            t_s = ""
            system = []
        t_su = render(system + [user])
        t_sua = render(system + [user, assistant])
        t_suau = render(system + [user, assistant, user2])
        gen = render(system + [user], generation=True)
        problem = None
        if supports_system and not t_su.startswith(t_s):
            problem = "rendering a user turn changes the system turn"
        elif not t_sua.startswith(t_su) or not t_suau.startswith(t_sua):
            problem = "rendering a turn changes the turns before it"
        elif not gen.startswith(t_su):
            problem = "the generation prompt is not appended after the last turn"
        if problem:
            raise UserError(f"the chat template of this tokenizer is not concatenative ({problem}); in-context RL "
                            "needs a template where each turn is appended after the previous ones")
        system_prefix, system_suffix = t_s.split(_S) if supports_system else ("", "")
        user_prefix, user_suffix = t_su[len(t_s):].split(_U)
        assistant_prefix, assistant_suffix = t_sua[len(t_su):].split(_A)
        if gen[len(t_su):] != assistant_prefix:
            # Some templates open the assistant turn differently for generation; prefer what generation uses.
            assistant_prefix = gen[len(t_su):]
        fmt = cls(system_prefix, system_suffix, user_prefix, user_suffix, assistant_prefix, assistant_suffix,
                  supports_system)
        expected = t_sua + user_prefix + _U2 + user_suffix
        if t_suau != expected:
            raise UserError("the chat template of this tokenizer renders a second user turn differently from the "
                            "first; in-context RL needs a template where turns are rendered the same everywhere")
        return fmt


# A neutral format for tokenizers without a chat template (base models).
PLAIN_FORMAT = ChatFormat("System: ", "\n\n", "User: ", "\n", "Assistant:", "\n\n", True)


class Tokens:
    """Cached piecewise tokenization (no special tokens added, special-token strings parsed)."""

    def __init__(self, tokenizer, chat_format: ChatFormat | None = None):
        self.tokenizer = tokenizer
        self.format = chat_format or ChatFormat.from_tokenizer(tokenizer)
        self._encode = lru_cache(maxsize=200_000)(self._encode_uncached)
        suffix_ids = self.encode(self.format.assistant_suffix)
        if not suffix_ids:
            raise UserError("the chat template has an empty assistant suffix: there is no end-of-turn token")
        # The end-of-turn token closes every answer; constrained decoding ends each label with it.
        self.end_of_turn_id: int = suffix_ids[0]
        self.assistant_suffix_rest: tuple[int, ...] = tuple(suffix_ids[1:])

    def _encode_uncached(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False)) if text else ()

    def encode(self, text: str) -> tuple[int, ...]:
        return self._encode(text)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


@dataclass
class Conversation:
    """A conversation built turn by turn into token ids and a loss mask over trained answer tokens.

    A user message stays open until the next assistant turn, so feedback and the next query share one user
    message, as in the paper's prompts (joined by `separator`)."""

    tokens: Tokens
    separator: str = "\n\n"
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    user_open: bool = False

    def _emit(self, ids, trained: bool = False) -> None:
        self.ids.extend(ids)
        self.mask.extend([1 if trained else 0] * len(ids))

    def system(self, text: str) -> Conversation:
        fmt = self.tokens.format
        if fmt.supports_system:
            self._emit(self.tokens.encode(fmt.system_prefix + text + fmt.system_suffix))
        else:
            self.user(text)
        return self

    def user(self, text: str) -> Conversation:
        fmt = self.tokens.format
        if self.user_open:
            self._emit(self.tokens.encode(self.separator + text))
        else:
            self._emit(self.tokens.encode(fmt.user_prefix + text))
            self.user_open = True
        return self

    def assistant_prompt(self, answer_prefix: str) -> Conversation:
        """Close the user message and open an assistant turn up to `answer_prefix` (e.g. 'Intent:')."""
        fmt = self.tokens.format
        text = (fmt.user_suffix if self.user_open else "") + fmt.assistant_prefix + answer_prefix
        self.user_open = False
        self._emit(self.tokens.encode(text))
        return self

    def assistant_answer(self, answer_prefix: str, answer: str, trained: bool = False,
                         train_end_of_turn: bool = True) -> Conversation:
        """A complete assistant turn; `trained` puts the answer tokens and (if `train_end_of_turn`) the
        end-of-turn token in the mask."""
        self.assistant_prompt(answer_prefix)
        ids = self.answer_ids(answer_prefix, answer)
        self._emit(ids[:-1], trained)
        self._emit(ids[-1:], trained and train_end_of_turn)
        self._emit(self.tokens.assistant_suffix_rest)
        return self

    def answer_ids(self, answer_prefix: str, answer: str) -> tuple[int, ...]:
        """Token ids of an answer after the prompt, end-of-turn included: what constrained decoding scores."""
        return self.tokens.encode(answer_text(answer_prefix, answer)) + (self.tokens.end_of_turn_id,)

    def mark(self) -> int:
        return len(self.ids)


def answer_text(answer_prefix: str, answer: str) -> str:
    """The answer as written after its prefix: 'Intent:' + ' card arrival'; without a prefix, the bare answer."""
    return f" {answer}" if answer_prefix else answer


def chat_prompt_ids(tokenizer, user_turn: str) -> list[int]:
    """One user turn in the model's own chat template (with its default system prompt, if the template adds one),
    ending with the assistant header: how the forgetting checks and general-chat replay ask a question."""
    return list(tokenizer.apply_chat_template([{"role": "user", "content": user_turn}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))
