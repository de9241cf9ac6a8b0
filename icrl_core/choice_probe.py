"""A large forgetting probe: multiple-choice general-ability items scored by likelihood.

Why a second forgetting measure: the greedy question check (general_ability.py) has ~200 hand-written questions,
so its paired 95% interval is about +-6 points and a 2-point change cannot be resolved. This probe generates
~1500 items from a seed (arithmetic, number order, comparisons, calendar and alphabet order, capitals,
antonyms, irregular past tenses, first letters of words), each with one correct answer and distractors, and asks the model which answer
it finds most likely as its reply (the zero-shot multiple-choice protocol of lm-evaluation-harness's `acc`):

    score(answer) = sum_t log p(answer_t | chat(question), answer_<t)   over the answer tokens + end of turn

The item is correct when the correct answer has the highest score. Scoring is strict (no string matching) and
deterministic, and base and trained model see identical items, so their difference is paired
(general_ability.paired_change). Ending each answer with the end-of-turn token makes "1" and "12" distinct
complete replies instead of one being a prefix of the other.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from icrl_core.chat import Tokens, chat_prompt_ids


@dataclass(frozen=True)
class ChoiceItem:
    family: str
    question: str
    answer: str
    distractors: tuple[str, ...]

    @property
    def choices(self) -> tuple[str, ...]:
        return (self.answer, *self.distractors)


# Hand-written lists (facts, not data files); each is unambiguous.
CAPITALS = [
    ("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"), ("Japan", "Tokyo"),
    ("the United Kingdom", "London"), ("Russia", "Moscow"), ("China", "Beijing"), ("Egypt", "Cairo"),
    ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Canada", "Ottawa"), ("Australia", "Canberra"),
    ("Ireland", "Dublin"), ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Austria", "Vienna"), ("Poland", "Warsaw"),
    ("India", "New Delhi"), ("Mexico", "Mexico City"), ("Argentina", "Buenos Aires"), ("Kenya", "Nairobi"),
    ("Thailand", "Bangkok"), ("South Korea", "Seoul"), ("the Netherlands", "Amsterdam"), ("Belgium", "Brussels"),
    ("Denmark", "Copenhagen"), ("Finland", "Helsinki"), ("Turkey", "Ankara"), ("Peru", "Lima"),
    ("Hungary", "Budapest"), ("the Czech Republic", "Prague"), ("Romania", "Bucharest"), ("Bulgaria", "Sofia"),
    ("Serbia", "Belgrade"), ("Croatia", "Zagreb"), ("Ukraine", "Kyiv"), ("Iceland", "Reykjavik"),
    ("Switzerland", "Bern"), ("Chile", "Santiago"), ("Colombia", "Bogota"), ("Venezuela", "Caracas"),
    ("Cuba", "Havana"), ("Ecuador", "Quito"), ("Uruguay", "Montevideo"), ("Paraguay", "Asuncion"),
    ("Bolivia", "La Paz"), ("Iran", "Tehran"), ("Iraq", "Baghdad"), ("Syria", "Damascus"), ("Lebanon", "Beirut"),
    ("Jordan", "Amman"), ("Saudi Arabia", "Riyadh"), ("Afghanistan", "Kabul"), ("Pakistan", "Islamabad"),
    ("Bangladesh", "Dhaka"), ("Nepal", "Kathmandu"), ("Indonesia", "Jakarta"), ("the Philippines", "Manila"),
    ("Vietnam", "Hanoi"), ("Malaysia", "Kuala Lumpur"), ("Singapore", "Singapore"), ("Ethiopia", "Addis Ababa"),
    ("Ghana", "Accra"), ("Nigeria", "Abuja"), ("Morocco", "Rabat"), ("Algeria", "Algiers"), ("Tunisia", "Tunis"),
    ("Libya", "Tripoli"), ("Sudan", "Khartoum"), ("Uganda", "Kampala"), ("Senegal", "Dakar"),
    ("New Zealand", "Wellington"), ("Israel", "Jerusalem"), ("Qatar", "Doha"), ("Mongolia", "Ulaanbaatar"),
    ("North Korea", "Pyongyang"), ("Taiwan", "Taipei"), ("Estonia", "Tallinn"), ("Latvia", "Riga"),
    ("Lithuania", "Vilnius"), ("Slovakia", "Bratislava"), ("Slovenia", "Ljubljana"), ("Albania", "Tirana"),
    ("Cyprus", "Nicosia"), ("Malta", "Valletta"), ("Luxembourg", "Luxembourg"), ("Zimbabwe", "Harare"),
    ("Zambia", "Lusaka"), ("Angola", "Luanda"), ("Tanzania", "Dodoma"), ("Jamaica", "Kingston"),
]
ANTONYMS = [
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("happy", "sad"), ("light", "dark"),
    ("old", "young"), ("open", "closed"), ("full", "empty"), ("hard", "soft"), ("wet", "dry"), ("high", "low"),
    ("early", "late"), ("rich", "poor"), ("strong", "weak"), ("heavy", "light"), ("long", "short"),
    ("thick", "thin"), ("loud", "quiet"), ("clean", "dirty"), ("good", "bad"), ("true", "false"),
    ("win", "lose"), ("push", "pull"), ("buy", "sell"), ("give", "take"), ("start", "finish"),
    ("inside", "outside"), ("above", "below"), ("before", "after"), ("day", "night"), ("left", "right"),
    ("first", "last"), ("friend", "enemy"), ("question", "answer"), ("north", "south"), ("east", "west"),
    ("summer", "winter"), ("love", "hate"), ("always", "never"), ("easy", "difficult"), ("safe", "dangerous"),
    ("cheap", "expensive"), ("wide", "narrow"), ("deep", "shallow"), ("sweet", "sour"), ("awake", "asleep"),
    ("alive", "dead"), ("remember", "forget"), ("accept", "refuse"),
]
PAST_TENSES = [
    ("go", "went"), ("eat", "ate"), ("see", "saw"), ("take", "took"), ("come", "came"), ("give", "gave"),
    ("run", "ran"), ("write", "wrote"), ("speak", "spoke"), ("drink", "drank"), ("swim", "swam"),
    ("sing", "sang"), ("begin", "began"), ("know", "knew"), ("grow", "grew"), ("throw", "threw"), ("fly", "flew"),
    ("draw", "drew"), ("drive", "drove"), ("ride", "rode"), ("rise", "rose"), ("break", "broke"),
    ("choose", "chose"), ("freeze", "froze"), ("steal", "stole"), ("wake", "woke"), ("forget", "forgot"),
    ("get", "got"), ("sit", "sat"), ("stand", "stood"), ("understand", "understood"), ("buy", "bought"),
    ("bring", "brought"), ("think", "thought"), ("teach", "taught"), ("catch", "caught"), ("fight", "fought"),
    ("seek", "sought"), ("sell", "sold"), ("tell", "told"), ("find", "found"), ("hold", "held"), ("feel", "felt"),
    ("keep", "kept"), ("sleep", "slept"), ("leave", "left"), ("meet", "met"), ("lose", "lost"), ("pay", "paid"),
    ("say", "said"), ("make", "made"), ("hear", "heard"), ("build", "built"), ("send", "sent"), ("spend", "spent"),
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
LETTERS = [chr(c) for c in range(ord("A"), ord("Z") + 1)]


def _number_distractors(answer: int, rng: random.Random, n: int = 3) -> tuple[str, ...]:
    """Near misses of the same kind: off by one, off by ten, a digit swap; all distinct and non-negative."""
    pool = [answer - 1, answer + 1, answer + 10, answer - 10, answer + 2, answer - 2]
    digits = str(answer)
    if len(digits) == 2 and digits[0] != digits[1]:
        pool.append(int(digits[::-1]))
    pool = [p for p in dict.fromkeys(pool) if p >= 0 and p != answer]
    return tuple(str(p) for p in rng.sample(pool, n))


def _word_distractors(answer: str, pool: list[str], rng: random.Random, n: int = 3) -> tuple[str, ...]:
    others = sorted({p for p in pool if p != answer})
    return tuple(rng.sample(others, n))


def _arithmetic(rng: random.Random, per_family: int) -> list[ChoiceItem]:
    items = []
    pairs = rng.sample([(a, b) for a in range(2, 60) for b in range(2, 60)], per_family)
    for a, b in pairs:
        items.append(ChoiceItem("addition", f"What is {a} + {b}?", str(a + b), _number_distractors(a + b, rng)))
    pairs = rng.sample([(a, b) for a in range(12, 100) for b in range(2, 60) if a - b >= 2], per_family)
    for a, b in pairs:
        items.append(ChoiceItem("subtraction", f"What is {a} - {b}?", str(a - b), _number_distractors(a - b, rng)))
    for a in range(2, 13):
        for b in range(2, 13):
            items.append(ChoiceItem("multiplication", f"What is {a} times {b}?", str(a * b),
                                    _number_distractors(a * b, rng)))
    return items


def _number_order(rng: random.Random, per_family: int) -> list[ChoiceItem]:
    items = []
    for n in rng.sample(range(3, 1000), per_family):
        after = rng.random() < 0.5
        answer = n + 1 if after else n - 1
        question = f"What number comes {'after' if after else 'before'} {n}?"
        items.append(ChoiceItem("number_order", question, str(answer), _number_distractors(answer, rng)))
    pairs = rng.sample([(a, b) for a in range(1, 100) for b in range(1, 100) if a != b], per_family)
    for a, b in pairs:
        larger = rng.random() < 0.5
        answer, other = (max(a, b), min(a, b)) if larger else (min(a, b), max(a, b))
        question = f"Which number is {'larger' if larger else 'smaller'}, {a} or {b}?"
        items.append(ChoiceItem("comparison", question, str(answer), (str(other),)))
    return items


def _sequences(rng: random.Random) -> list[ChoiceItem]:
    items = []
    for name, sequence, cyclic in (("day", DAYS, True), ("month", MONTHS, True), ("letter", LETTERS, False)):
        for i, word in enumerate(sequence):
            for direction, j in (("after", i + 1), ("before", i - 1)):
                if not cyclic and not 0 <= j < len(sequence):
                    continue
                answer = sequence[j % len(sequence)]
                where = " in the alphabet" if name == "letter" else ""
                items.append(ChoiceItem(f"{name}_order", f"What {name} comes {direction} {word}{where}?", answer,
                                        _word_distractors(answer, [w for w in sequence if w != word], rng)))
    return items


def _word_facts(rng: random.Random) -> list[ChoiceItem]:
    items = []
    capitals = [c for _, c in CAPITALS]
    for country, capital in CAPITALS:
        items.append(ChoiceItem("capital", f"What is the capital of {country}?", capital,
                                _word_distractors(capital, capitals, rng)))
    words = [w for pair in ANTONYMS for w in pair]
    for a, b in ANTONYMS:
        for word, opposite in ((a, b), (b, a)):
            pool = [w for w in words if w not in (word, opposite)]
            items.append(ChoiceItem("antonym", f"What is the opposite of \"{word}\"?", opposite,
                                    _word_distractors(opposite, pool, rng)))
    for verb, past in PAST_TENSES:
        regularized = verb + ("d" if verb.endswith("e") else "ed")
        others = _word_distractors(past, [p for _, p in PAST_TENSES], rng, 2)
        items.append(ChoiceItem("past_tense", f"What is the past tense of \"{verb}\"?", past,
                                (regularized, *others)))
    vocabulary = sorted({w for w in words + [v for v, _ in PAST_TENSES] + DAYS + MONTHS + capitals if " " not in w})
    for word in vocabulary:
        first = word[0].upper()
        items.append(ChoiceItem("first_letter", f"What is the first letter of the word \"{word}\"?", first,
                                _word_distractors(first, LETTERS, rng)))
    return items


def generate_items(seed: int = 0, per_family: int = 200) -> list[ChoiceItem]:
    """The probe's items, in a fixed shuffled order (deterministic in `seed`), so a prefix is a balanced subset."""
    rng = random.Random(seed)
    items = _arithmetic(rng, per_family) + _number_order(rng, per_family) + _sequences(rng) + _word_facts(rng)
    rng.shuffle(items)
    return items


def choice_scores(policy, tokens: Tokens, items: list[ChoiceItem], progress=None,
                  end_of_turn: bool = True, engine=None, adapter: str | None = None) -> list[list[float]]:
    """score[i][j] = sum of log p over choice j's tokens and the end-of-turn token, as the reply to item i
    (`end_of_turn=False`: the choice's tokens only, i.e. how likely the reply *starts* with it).

    Scored by an inference engine's `continuation_logprobs` (default: the torch engine over `policy`, which
    computes the chat-template header every prompt starts with once, then per item its question tokens and all
    its choices in one tree-attention pass: the last prompt token is the root, each choice a chain below it)."""
    from icrl_core.inference.base import ContinuationRequest

    if engine is None:
        from icrl_core.inference.torch_backend import TorchEngine
        from icrl_core.kernels import PrefixCache

        engine = TorchEngine(policy, cache=PrefixCache(policy, capacity=2), adapter=adapter)
    scores = []
    for item in (progress(items) if progress else items):
        answers = tuple(tuple(tokens.encode(choice)) + ((tokens.end_of_turn_id,) if end_of_turn else ())
                        for choice in item.choices)
        (logprobs,) = engine.continuation_logprobs(
            [ContinuationRequest(tuple(chat_prompt_ids(tokens.tokenizer, item.question)), answers, adapter)])
        scores.append([float(torch.as_tensor(lp, dtype=torch.float32).sum()) for lp in logprobs])
    return scores


@dataclass
class ProbeReport:
    accuracy: float
    n_items: int
    by_family: dict[str, float]
    correct: list[bool]


def measure_choices(policy, tokens: Tokens, items: list[ChoiceItem], progress=None,
                    end_of_turn: bool = True) -> ProbeReport:
    """Accuracy (correct answer scored strictly highest) overall and per family."""
    scores = choice_scores(policy, tokens, items, progress=progress, end_of_turn=end_of_turn)
    correct = [s[0] > max(s[1:]) for s in scores]
    families: dict[str, list[bool]] = {}
    for item, ok in zip(items, correct):
        families.setdefault(item.family, []).append(ok)
    by_family = {f: sum(v) / len(v) for f, v in sorted(families.items())}
    return ProbeReport(sum(correct) / len(correct), len(correct), by_family, correct)
