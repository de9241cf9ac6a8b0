"""Prompt templates of the in-context RL protocol (Monea et al., 2024) and of training episodes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

ICRL_SYSTEM = (
    "You are an useful assistant. Answer the following questions. Feedback will indicate if you answered "
    "correctly. You must answer correctly, using previous feedback to make better predictions.{task_description}"
)
ICL_SYSTEM = "You are an useful assistant. Answer the following questions.{task_description}"


class PromptTemplate(BaseModel):
    """How queries, answers and feedback are written. Defaults follow the paper's prompts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    system_icrl: str = Field(ICRL_SYSTEM, description="System prompt when the context carries reward feedback.")
    system_icl: str = Field(ICL_SYSTEM, description="System prompt for supervised ICL and zero-shot.")
    task_description: str = Field("", description="Appended to the system prompt after a newline.")
    query_prefix: str = Field("", description="Written before each query, e.g. 'Query:'.")
    answer_prefix: str = Field("", description="Opens each answer, e.g. 'Intent:'.")
    positive_feedback: str = Field("'{prediction}' is the correct answer! Good job!")
    negative_feedback: str = Field("The answer '{prediction}' is wrong! You can do better!")
    separator: str = Field("\n\n", description="Joins feedback and the next query in one user message.")

    def system(self, with_feedback: bool) -> str:
        text = self.system_icrl if with_feedback else self.system_icl
        return text.format(task_description=f"\n{self.task_description}")

    def query(self, prompt: str) -> str:
        return f"{self.query_prefix} {prompt}" if self.query_prefix else prompt

    def feedback(self, prediction: str, reward: float) -> str:
        text = self.positive_feedback if reward > 0 else self.negative_feedback
        return text.format(prediction=prediction)


# The paper's per-task prefixes (src/task/task.py of lil-lab/icrl).
INTENT = PromptTemplate(query_prefix="Query:", answer_prefix="Intent:")
TEMPLATES: dict[str, PromptTemplate] = {
    "banking77": INTENT,
    "clinc150": INTENT,
    "trec_coarse": PromptTemplate(query_prefix="Question:", answer_prefix="Type:"),
    "trec_fine": PromptTemplate(query_prefix="Question:", answer_prefix="Type:"),
    "nlu": PromptTemplate(query_prefix="Utterance:", answer_prefix="Intent:"),
}
GENERIC = PromptTemplate()
# Code tasks (icrl_core/code_rl.py): the query asks for a whole Python function; no answer prefix.
CODE_SYSTEM = "You are a careful Python programmer. Write correct, simple Python functions."
TEMPLATES["code_tasks"] = PromptTemplate(system_icrl=CODE_SYSTEM, system_icl=CODE_SYSTEM)


def register_template(task_type: str, template: PromptTemplate) -> None:
    TEMPLATES[task_type] = template


def template_for(task_type: str | None) -> PromptTemplate:
    """The template of a task type; `<task>_unsemantic` uses its task's template; unknown types the generic one."""
    if not task_type:
        return GENERIC
    if task_type in TEMPLATES:
        return TEMPLATES[task_type]
    base = task_type.removesuffix("_unsemantic")
    return TEMPLATES.get(base, GENERIC)
