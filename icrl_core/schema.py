"""The base of every config section. Its own module so an algorithm's schema can live beside the algorithm
(e.g. icrl_core/objectives.py, icrl_core/inference/config.py) and still be hung on the pipeline config by
icrl_core/config.py or tasks/settings.py."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())
