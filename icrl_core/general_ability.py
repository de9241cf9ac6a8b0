"""A forgetting check: does fine-tuning for in-context RL cost general ability?

Measure: greedy accuracy on a fixed set of simple factual and everyday questions written for this project
(capitals, arithmetic, science, language, common knowledge), asked as single chat turns with the model's own
chat template, scored by whether an accepted answer appears as a whole word in the reply. Why this measure:
it exercises exactly what LoRA fine-tuning on classification episodes could damage (following a plain chat
instruction and recalling facts in free-form answers), it is cheap (one short greedy generation per question),
deterministic, and the base SmolLM2-135M answers a good share of it, so a drop is visible. With 200 questions,
one question is 0.5 points.

A second, finer signal: mean token negative log-likelihood of the reference answers given the question
(teacher-forced), which moves before greedy accuracy does.

Base and trained model answer the same questions, so their difference is a paired one: `paired_change` reports
how many answers flipped each way, the change's standard error and 95% interval over questions, and McNemar's
exact test. With ~200 questions one standard error is ~3 points, so a change of 2 points is not resolvable;
the flips show churn that a small net change can hide.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from icrl_core.chat import chat_prompt_ids

# (question, accepted answers). Written for this project; answers are short and unambiguous.
QUESTIONS: list[tuple[str, tuple[str, ...]]] = [
    ("What is the capital of France?", ("Paris",)),
    ("What is the capital of Italy?", ("Rome",)),
    ("What is the capital of Spain?", ("Madrid",)),
    ("What is the capital of Germany?", ("Berlin",)),
    ("What is the capital of Japan?", ("Tokyo",)),
    ("What is the capital of the United Kingdom?", ("London",)),
    ("What is the capital of Russia?", ("Moscow",)),
    ("What is the capital of China?", ("Beijing",)),
    ("What is the capital of Egypt?", ("Cairo",)),
    ("What is the capital of Greece?", ("Athens",)),
    ("What is the capital of Portugal?", ("Lisbon",)),
    ("What is the capital of Canada?", ("Ottawa",)),
    ("What is the capital of Australia?", ("Canberra",)),
    ("What is the capital of Ireland?", ("Dublin",)),
    ("What is the capital of Norway?", ("Oslo",)),
    ("What is the capital of Sweden?", ("Stockholm",)),
    ("What is the capital of Austria?", ("Vienna",)),
    ("What is the capital of Poland?", ("Warsaw",)),
    ("What is the capital of India?", ("New Delhi", "Delhi")),
    ("What is the capital of Mexico?", ("Mexico City",)),
    ("What is the capital of Argentina?", ("Buenos Aires",)),
    ("What is the capital of Kenya?", ("Nairobi",)),
    ("What is the capital of Thailand?", ("Bangkok",)),
    ("What is the capital of South Korea?", ("Seoul",)),
    ("What is the capital of the Netherlands?", ("Amsterdam",)),
    ("What is the capital of Belgium?", ("Brussels",)),
    ("What is the capital of Denmark?", ("Copenhagen",)),
    ("What is the capital of Finland?", ("Helsinki",)),
    ("What is the capital of Turkey?", ("Ankara",)),
    ("What is the capital of Peru?", ("Lima",)),
    ("What is 2 + 2?", ("4", "four")),
    ("What is 3 + 5?", ("8", "eight")),
    ("What is 7 + 6?", ("13", "thirteen")),
    ("What is 9 + 8?", ("17", "seventeen")),
    ("What is 10 + 15?", ("25", "twenty-five")),
    ("What is 12 - 5?", ("7", "seven")),
    ("What is 20 - 8?", ("12", "twelve")),
    ("What is 3 times 4?", ("12", "twelve")),
    ("What is 6 times 7?", ("42", "forty-two")),
    ("What is 5 times 5?", ("25", "twenty-five")),
    ("What is 9 times 3?", ("27", "twenty-seven")),
    ("What is 100 divided by 10?", ("10", "ten")),
    ("What is 18 divided by 2?", ("9", "nine")),
    ("What is half of 50?", ("25", "twenty-five")),
    ("What is 11 + 11?", ("22", "twenty-two")),
    ("How many days are in a week?", ("7", "seven")),
    ("How many months are in a year?", ("12", "twelve")),
    ("How many hours are in a day?", ("24", "twenty-four")),
    ("How many minutes are in an hour?", ("60", "sixty")),
    ("How many seconds are in a minute?", ("60", "sixty")),
    ("How many legs does a spider have?", ("8", "eight")),
    ("How many legs does a dog have?", ("4", "four")),
    ("How many sides does a triangle have?", ("3", "three")),
    ("How many sides does a square have?", ("4", "four")),
    ("How many sides does a hexagon have?", ("6", "six")),
    ("How many continents are there on Earth?", ("7", "seven")),
    ("How many planets are in our solar system?", ("8", "eight")),
    ("How many wheels does a bicycle have?", ("2", "two")),
    ("How many days are in a leap year?", ("366",)),
    ("How many centimeters are in a meter?", ("100", "hundred")),
    ("What is the largest planet in our solar system?", ("Jupiter",)),
    ("Which planet is known as the Red Planet?", ("Mars",)),
    ("What is the closest star to the Earth?", ("Sun",)),
    ("What do bees make?", ("honey",)),
    ("What gas do plants absorb from the air?", ("carbon dioxide", "CO2")),
    ("What gas do humans need to breathe?", ("oxygen",)),
    ("What is the chemical symbol for water?", ("H2O",)),
    ("What is the chemical symbol for gold?", ("Au",)),
    ("What is the freezing point of water in degrees Celsius?", ("0", "zero")),
    ("What is the boiling point of water in degrees Celsius?", ("100",)),
    ("What is the largest ocean on Earth?", ("Pacific",)),
    ("What is the longest river in Africa?", ("Nile",)),
    ("What is the tallest mountain in the world?", ("Everest",)),
    ("What is the largest desert in Africa?", ("Sahara",)),
    ("Which animal is known as the king of the jungle?", ("lion",)),
    ("What is the largest mammal in the world?", ("blue whale", "whale")),
    ("What is the fastest land animal?", ("cheetah",)),
    ("What animal has a long trunk?", ("elephant",)),
    ("What is the baby of a cat called?", ("kitten",)),
    ("What is the baby of a dog called?", ("puppy",)),
    ("What color is the sky on a clear day?", ("blue",)),
    ("What color is grass?", ("green",)),
    ("What color are ripe bananas?", ("yellow",)),
    ("What color do you get by mixing blue and yellow?", ("green",)),
    ("What color do you get by mixing red and white?", ("pink",)),
    ("What is the opposite of hot?", ("cold",)),
    ("What is the opposite of up?", ("down",)),
    ("What is the opposite of big?", ("small", "little")),
    ("What is the opposite of day?", ("night",)),
    ("What is the opposite of happy?", ("sad", "unhappy")),
    ("What is the opposite of fast?", ("slow",)),
    ("What is the opposite of open?", ("closed", "close", "shut")),
    ("What is the plural of mouse?", ("mice",)),
    ("What is the plural of child?", ("children",)),
    ("What is the plural of foot?", ("feet",)),
    ("What is the past tense of go?", ("went",)),
    ("What is the past tense of eat?", ("ate",)),
    ("Who wrote Romeo and Juliet?", ("Shakespeare",)),
    ("Who painted the Mona Lisa?", ("Leonardo", "da Vinci")),
    ("Who was the first person to walk on the Moon?", ("Armstrong",)),
    ("Who developed the theory of relativity?", ("Einstein",)),
    ("Who is known for the laws of motion and gravity?", ("Newton",)),
    ("What language is mainly spoken in Brazil?", ("Portuguese",)),
    ("What language is mainly spoken in Mexico?", ("Spanish",)),
    ("What language is mainly spoken in Germany?", ("German",)),
    ("What currency is used in Japan?", ("yen",)),
    ("What currency is used in the United States?", ("dollar",)),
    ("What currency is used in the United Kingdom?", ("pound",)),
    ("In which country are the pyramids of Giza?", ("Egypt",)),
    ("In which country is the Eiffel Tower?", ("France",)),
    ("In which city is the Statue of Liberty?", ("New York",)),
    ("In which country is the Great Wall?", ("China",)),
    ("On which continent is Kenya?", ("Africa",)),
    ("On which continent is Brazil?", ("South America",)),
    ("What is the main ingredient of bread?", ("flour", "wheat")),
    ("What do cows drink?", ("water",)),
    ("What fruit is used to make wine?", ("grape", "grapes")),
    ("What is frozen water called?", ("ice",)),
    ("What do we call a baby frog?", ("tadpole",)),
    ("What is the hardest natural substance?", ("diamond",)),
    ("What organ pumps blood through the body?", ("heart",)),
    ("What organ do humans use to think?", ("brain",)),
    ("How many bones are in the adult human body?", ("206",)),
    ("What is the largest organ of the human body?", ("skin",)),
    ("What is the primary language of Australia?", ("English",)),
    ("Which season comes after winter?", ("spring",)),
    ("Which season comes after summer?", ("autumn", "fall")),
    ("What is the first month of the year?", ("January",)),
    ("What is the last month of the year?", ("December",)),
    ("Which day comes after Monday?", ("Tuesday",)),
    ("Which day comes before Sunday?", ("Saturday",)),
    ("What shape has three sides?", ("triangle",)),
    ("What shape is a ball?", ("sphere", "round", "circle")),
    ("What instrument has black and white keys?", ("piano",)),
    ("What do you call a person who treats sick people?", ("doctor", "physician")),
    ("What do you call a person who teaches students?", ("teacher",)),
    ("What do you call a person who flies an airplane?", ("pilot",)),
    ("What tool do you use to cut paper?", ("scissors",)),
    ("What do you use to write on a blackboard?", ("chalk",)),
    ("What falls from clouds when it rains?", ("water", "rain", "raindrops")),
    ("What is the color of snow?", ("white",)),
    ("What is the color of coal?", ("black",)),
    ("What do caterpillars turn into?", ("butterfly", "butterflies", "moth")),
    ("What is the center of an atom called?", ("nucleus",)),
    ("What force keeps us on the ground?", ("gravity",)),
    ("What is the process by which plants make food from sunlight?", ("photosynthesis",)),
    ("What is the smallest prime number?", ("2", "two")),
    ("What is the square root of 81?", ("9", "nine")),
    ("What is 10 squared?", ("100",)),
    ("How many zeros are in one thousand?", ("3", "three")),
    ("What is the Roman numeral for 10?", ("X",)),
    ("What is the largest country in the world by area?", ("Russia",)),
    ("What is the smallest continent?", ("Australia", "Oceania")),
    ("Which ocean lies between Europe and North America?", ("Atlantic",)),
    ("What is the capital of the United States?", ("Washington",)),
    ("What is the capital of Switzerland?", ("Bern", "Berne")),
    ("What is the capital of Cuba?", ("Havana",)),
    ("What is the capital of Vietnam?", ("Hanoi",)),
    ("What is the capital of Chile?", ("Santiago",)),
    ("What is the capital of Colombia?", ("Bogota", "Bogotá")),
    ("What is the capital of Hungary?", ("Budapest",)),
    ("What is the capital of the Czech Republic?", ("Prague",)),
    ("What is the capital of Indonesia?", ("Jakarta", "Nusantara")),
    ("What is the capital of Saudi Arabia?", ("Riyadh",)),
    ("What is the capital of Iran?", ("Tehran",)),
    ("What is the capital of Iraq?", ("Baghdad",)),
    ("What is the capital of Nigeria?", ("Abuja",)),
    ("What is 15 + 27?", ("42", "forty-two")),
    ("What is 8 times 8?", ("64", "sixty-four")),
    ("What is 50 - 19?", ("31", "thirty-one")),
    ("What is 4 + 4 + 4?", ("12", "twelve")),
    ("What is 1000 minus 1?", ("999",)),
    ("How many legs does an insect have?", ("6", "six")),
    ("How many eyes does a human have?", ("2", "two")),
    ("How many fingers are on one human hand?", ("5", "five")),
    ("How many players are on a soccer team on the field?", ("11", "eleven")),
    ("How many strings does a standard guitar have?", ("6", "six")),
    ("What is the opposite of left?", ("right",)),
    ("What is the opposite of wet?", ("dry",)),
    ("What is the opposite of early?", ("late",)),
    ("What is the opposite of old?", ("new", "young")),
    ("What is the plural of tooth?", ("teeth",)),
    ("What is the past tense of run?", ("ran",)),
    ("What is the past tense of see?", ("saw",)),
    ("Which animal says moo?", ("cow",)),
    ("Which animal says woof?", ("dog",)),
    ("Which bird is a symbol of peace?", ("dove", "pigeon")),
    ("What animal is known for carrying its house on its back?", ("snail", "turtle", "tortoise")),
    ("What do pandas mainly eat?", ("bamboo",)),
    ("What is the main gas in the air we breathe?", ("nitrogen",)),
    ("What planet do we live on?", ("Earth",)),
    ("What is the natural satellite of the Earth?", ("Moon",)),
    ("What is the opposite of north?", ("south",)),
    ("What is the hottest planet in our solar system?", ("Venus",)),
    ("What metal is liquid at room temperature?", ("mercury",)),
    ("What is the largest bird in the world?", ("ostrich",)),
    ("Which vitamin do we get from sunlight?", ("vitamin D", "D")),
]


@dataclass
class AbilityReport:
    accuracy: float
    answer_nll: float
    n_questions: int
    answers: list[dict]


def is_correct(reply: str, accepted: tuple[str, ...]) -> bool:
    """An accepted answer appears as a whole word (or phrase) in the reply, ignoring case."""
    return any(re.search(rf"(?<![\w]){re.escape(a)}(?![\w])", reply, flags=re.IGNORECASE) for a in accepted)


@torch.no_grad()
def answer_nll(policy, question: str, answer: str) -> float:
    """Mean negative log-likelihood per token of `answer` as the assistant's reply to `question`."""
    tok = policy.tokenizer
    prompt = chat_prompt_ids(tok, question)
    answer_ids = tok.encode(answer, add_special_tokens=False)
    ids = torch.tensor([list(prompt) + answer_ids])
    logits, _, _ = policy.forward(ids)
    logprobs = torch.log_softmax(logits[0, len(prompt) - 1:-1].float().cpu(), dim=-1)
    picked = logprobs.gather(-1, torch.tensor(answer_ids).unsqueeze(-1)).squeeze(-1)
    return float(-picked.mean())


def measure(policy, questions=QUESTIONS, max_new_tokens: int = 64, progress=None) -> AbilityReport:
    """Greedy accuracy and reference-answer NLL over `questions`."""
    from icrl_core.generation import greedy_chat_answer

    answers, nlls = [], []
    iterator = progress(questions) if progress else questions
    for question, accepted in iterator:
        reply = greedy_chat_answer(policy, question, max_new_tokens=max_new_tokens)
        correct = is_correct(reply, accepted)
        nll = answer_nll(policy, question, accepted[0])
        nlls.append(nll)
        answers.append({"question": question, "reply": reply, "correct": correct, "answer_nll": nll})
    accuracy = sum(a["correct"] for a in answers) / len(answers)
    return AbilityReport(accuracy, sum(nlls) / len(nlls), len(answers), answers)


@dataclass
class PairedChange:
    change: float  # trained accuracy - base accuracy
    standard_error: float
    ci95_low: float
    ci95_high: float
    became_correct: int  # wrong for the base model, right for the trained one
    became_wrong: int  # right for the base model, wrong for the trained one
    mcnemar_p: float  # exact two-sided McNemar test on the flips
    n_questions: int


def paired_change(base_correct: list[bool], trained_correct: list[bool]) -> PairedChange:
    """Paired difference of two models' correctness on the same n questions.

    d_i = trained_i - base_i in {-1, 0, 1};  change = mean(d);  SE = std(d, ddof=1) / sqrt(n);
    95% interval = change +- 1.96 SE (normal approximation over questions);
    McNemar exact: with b = became_correct, c = became_wrong, p = min(1, 2 * P[Binom(b + c, 1/2) <= min(b, c)]).
    """
    if len(base_correct) != len(trained_correct) or not base_correct:
        raise ValueError("paired_change needs two equally long, non-empty answer lists")
    n = len(base_correct)
    diffs = [int(t) - int(b) for b, t in zip(base_correct, trained_correct)]
    change = sum(diffs) / n
    variance = sum((d - change) ** 2 for d in diffs) / (n - 1) if n > 1 else 0.0
    se = math.sqrt(variance / n)
    became_correct = sum(d == 1 for d in diffs)
    became_wrong = sum(d == -1 for d in diffs)
    flips = became_correct + became_wrong
    tail = sum(math.comb(flips, i) for i in range(min(became_correct, became_wrong) + 1)) / 2 ** flips
    return PairedChange(change, se, change - 1.96 * se, change + 1.96 * se, became_correct, became_wrong,
                        min(1.0, 2 * tail), n)
