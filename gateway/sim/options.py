"""Options of one simulated engine (shared by the in-process runner and the command line)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from gateway.sim.faults import FaultSpec
from gateway.sim.profiles import Profile, get_profile

# The APIs besides text generation each flavour can simulate. A real engine serves them only with another model
# or a flag (llama-server --embeddings / --reranking or a model that hears; a vLLM pooling or speech model;
# SGLang --is-embedding), and refuses them otherwise: vLLM mounts no route (404), llama-server answers 501
# (tests/e2e/OBSERVED.md), SGLang 400. score and translations are no routes of llama-server at all.
EXTRA_APIS: dict[str, tuple[str, ...]] = {
    "vllm": ("embeddings", "rerank", "score", "transcriptions", "translations"),
    "sglang": ("embeddings", "rerank"),
    "llamacpp": ("embeddings", "rerank", "transcriptions"),
}


@dataclass(frozen=True)
class SimOptions:
    """Everything that defines one simulated engine process."""

    engine: str
    model: str = "sim-model"
    profile: str | None = None  # None: the engine's fast default profile
    slots: int | None = None  # llama.cpp -np; vLLM/SGLang max running requests
    seed: int = 0
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    warmup_s: float = 0.0
    faults: FaultSpec = field(default_factory=FaultSpec)
    served_model_names: tuple[str, ...] = ()  # extra names the engine answers to
    max_model_len: int | None = None  # override the context length (llama.cpp: per slot)
    report_cached_tokens: bool = False  # vLLM --enable-prompt-tokens-details / SGLang --enable-cache-report
    # Responses API `store`: None is the engine's default (vLLM off unless VLLM_ENABLE_RESPONSES_API_STORE=1,
    # SGLang on); llama-server stores nothing either way.
    responses_store: bool | None = None
    # EXTRA_APIS the simulated model serves (none: a text model, as the e2e tests' tiny models are). It keeps
    # generating text too, which a real engine's pooling or speech model would not.
    serves: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        known = EXTRA_APIS.get(self.engine, ())
        unknown = sorted(set(self.serves) - set(known))
        if unknown:
            raise ValueError(f"the {self.engine} flavour does not simulate {', '.join(unknown)} "
                             f"(it can serve: {', '.join(known) or 'none'})")
        if self.engine == "llamacpp" and "rerank" in self.serves:  # llama-server --reranking embeds too
            object.__setattr__(self, "serves", frozenset(self.serves) | {"embeddings"})
        else:
            object.__setattr__(self, "serves", frozenset(self.serves))

    def resolve_profile(self) -> Profile:
        """The profile these options run, with the slot and context overrides applied."""
        profile = get_profile(self.engine, self.profile).with_slots(self.slots)
        if self.max_model_len is not None:
            if self.max_model_len < 16:
                raise ValueError("max_model_len must be at least 16")
            # For llama.cpp the override is the per-slot context (-c is split over the slots).
            ctx = self.max_model_len * profile.max_running if profile.engine == "llamacpp" else 0
            profile = replace(profile, max_model_len=self.max_model_len, ctx_tokens=ctx)
        return profile

    @property
    def model_names(self) -> tuple[str, ...]:
        """Served names, the primary first, without duplicates."""
        names = [self.model, *self.served_model_names]
        return tuple(dict.fromkeys(names))
