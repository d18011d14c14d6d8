"""Engine profiles: the cost-model numbers of each simulated engine, read from profiles/*.toml."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from importlib import resources

ENGINES = ("vllm", "sglang", "llamacpp")

# The profile an engine gets when none is named: fast, for functional tests.
DEFAULT_PROFILE = {"vllm": "tiny-vllm", "sglang": "tiny-sglang", "llamacpp": "tiny-llamacpp"}


@dataclass(frozen=True)
class Profile:
    """One engine on one card with one model, as numbers for the step cost model.

    A scheduler step that carries `seqs` sequences and `prefill` prompt tokens lasts
    itl_base_s + itl_per_seq_s * seqs + prefill / prefill_tps seconds: the base is the
    weight read every step pays, the per-sequence term is why ITL rises with the batch,
    and prompt tokens share one prefill rate across all prefills in the step. Decoding also
    reads each decoding sequence's whole KV cache every step: kv_read_s_per_token times the
    tokens those sequences hold (0: off), so a long context slows every stream batched with it.
    """

    name: str
    engine: str
    title: str
    frontend_s: float  # per-request work before the scheduler sees it (HTTP, template, tokenizer)
    itl_base_s: float
    itl_per_seq_s: float
    prefill_tps: float
    max_running: int  # max_num_seqs / max_running_requests / llama.cpp slots
    max_step_tokens: int  # max_num_batched_tokens / chunked_prefill_size / n_batch
    kv_tokens: int  # KV pool in tokens; admission waits beyond it
    max_model_len: int  # context length (llama.cpp: n_ctx_train)
    ctx_tokens: int = 0  # llama.cpp -c, split evenly over the slots; 0 means max_model_len
    prefix_cache_tokens: int = 262_144  # bound on the simulated prefix cache
    n_params: int = 30_500_000_000
    source: str = ""
    kv_read_s_per_token: float = 0.0  # decode attention: seconds per KV token read in a step

    def step_seconds(self, seqs: int, prefill_tokens: int, context_tokens: int = 0) -> float:
        """Modelled duration of one scheduler step (`context_tokens`: KV held by its decoding sequences)."""
        return (self.itl_base_s + self.itl_per_seq_s * seqs + prefill_tokens / self.prefill_tps
                + self.kv_read_s_per_token * context_tokens)

    def with_slots(self, slots: int | None) -> Profile:
        """The same profile with the batch cap (or llama.cpp slot count) overridden."""
        if slots is None:
            return self
        if slots < 1:
            raise ValueError("slots must be at least 1")
        return dataclasses.replace(self, max_running=slots)

    def slot_ctx(self) -> int:
        """llama.cpp per-slot context: -c divided by -np, as with an explicit --parallel."""
        total = self.ctx_tokens or self.max_model_len
        return max(total // max(self.max_running, 1), 16)


_FIELDS = {f.name for f in dataclasses.fields(Profile)}


def load_profiles() -> dict[str, Profile]:
    """Every profile in the package's TOML files, by name (read fresh: the files are tiny)."""
    out: dict[str, Profile] = {}
    folder = resources.files("gateway.sim").joinpath("profiles")
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".toml"):
            continue
        data = tomllib.loads(entry.read_text(encoding="utf-8"))
        for name, table in data.items():
            unknown = set(table) - _FIELDS
            if unknown:
                raise ValueError(f"profile {name}: unknown keys {sorted(unknown)}")
            if name in out:
                raise ValueError(f"profile {name} defined twice")
            profile = Profile(name=name, **table)
            if profile.engine not in ENGINES:
                raise ValueError(f"profile {name}: unknown engine {profile.engine!r}")
            out[name] = profile
    return out


def get_profile(engine: str, name: str | None = None) -> Profile:
    """The named profile (or the engine's default), checked to belong to that engine."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")
    profiles = load_profiles()
    key = name or DEFAULT_PROFILE[engine]
    if key == "default":
        key = DEFAULT_PROFILE[engine]
    if key not in profiles:
        raise ValueError(f"unknown profile {key!r}; known: {', '.join(sorted(profiles))}")
    profile = profiles[key]
    if profile.engine != engine:
        raise ValueError(f"profile {key!r} is a {profile.engine} profile, not {engine}")
    return profile
