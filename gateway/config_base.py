"""What every configuration section shares: strict frozen models, and the request classes sections may name."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

CLASS_NAMES = ("long_output", "long_prompt", "interactive", "default")


class Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
