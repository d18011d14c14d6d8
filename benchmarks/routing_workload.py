"""The mixed routing workload: generation, summarization, agents sharing system prompts, multi-turn sessions."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

MODEL = "qwen3-30b"
# Three-letter words with a leading space: one token each for a BPE-like tokenizer (four characters).
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def words(rng: random.Random, tokens: int) -> str:
    return "".join(" " + "".join(rng.choice(_LETTERS) for _ in range(3)) for _ in range(tokens))


@dataclass(frozen=True)
class Kind:
    """One request kind: its sizes and its service-level objective (seconds)."""

    name: str
    prompt_tokens: int
    output_tokens: int
    ttft_slo: float
    itl_slo: float


GENERATION = Kind("generation", 110, 1000, 2.0, 0.05)
SUMMARIZATION = Kind("summarization", 1010, 100, 2.0, 0.05)
AGENT = Kind("agent", 2100, 150, 2.0, 0.05)
INTERACTIVE = Kind("interactive", 300, 120, 1.0, 0.05)  # prompt: first turn; it grows by each turn
# A long chat history: more than a llama.cpp slot holds (8,192 of -c 32768 over 4 slots), well within 32k.
LONG_CHAT = Kind("long_chat", 12000, 200, 8.0, 0.05)
KINDS = (GENERATION, SUMMARIZATION, AGENT, INTERACTIVE, LONG_CHAT)
AGENT_SYSTEM_PROMPTS = 3
SESSION_TURNS = 4
USER_TURN_TOKENS = 60
THINK_S = 1.0


@dataclass(frozen=True)
class Load:
    """Poisson arrival rates per second; a session counts once and then sends SESSION_TURNS turns."""

    name: str
    generation: float
    summarization: float
    agent: float
    sessions: float
    long_chat: float = 0.0


@dataclass
class Arrival:
    at: float
    kind: Kind
    body: dict | None = None  # None for a session: the client builds each turn from the replies
    session: str | None = None
    system: str = ""
    turn_texts: list[str] = field(default_factory=list)


def body(kind: Kind, messages: list[dict]) -> dict:
    return {"model": MODEL, "messages": messages, "max_tokens": kind.output_tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}


def schedule(load: Load, duration_s: float, seed: int) -> list[Arrival]:
    """Every arrival of one run, in time order; the same seed gives the same run for every policy."""
    rng = random.Random(seed)
    systems = [words(random.Random(1000 + i), AGENT.prompt_tokens - 100) for i in range(AGENT_SYSTEM_PROMPTS)]
    out: list[Arrival] = []

    def poisson(rate: float, make) -> None:
        t = rng.expovariate(rate) if rate > 0 else duration_s
        while t < duration_s:
            out.append(make(t))
            t += rng.expovariate(rate)

    poisson(load.generation, lambda t: Arrival(t, GENERATION, body(GENERATION, [
        {"role": "user", "content": "Write a long story about" + words(rng, GENERATION.prompt_tokens - 15)}])))
    poisson(load.summarization, lambda t: Arrival(t, SUMMARIZATION, body(SUMMARIZATION, [
        {"role": "system", "content": "Summarize the document."},
        {"role": "user", "content": words(rng, SUMMARIZATION.prompt_tokens - 20)}])))
    poisson(load.agent, lambda t: Arrival(t, AGENT, body(AGENT, [
        {"role": "system", "content": systems[rng.randrange(AGENT_SYSTEM_PROMPTS)]},
        {"role": "user", "content": words(rng, 90)}])))
    n = [0]

    def session(t: float) -> Arrival:
        n[0] += 1
        return Arrival(t, INTERACTIVE, None, session=f"s{seed}-{n[0]}",
                       system=words(rng, INTERACTIVE.prompt_tokens - USER_TURN_TOKENS - 10),
                       turn_texts=[words(rng, USER_TURN_TOKENS) for _ in range(SESSION_TURNS)])

    poisson(load.sessions, session)
    poisson(load.long_chat, lambda t: Arrival(t, LONG_CHAT, body(LONG_CHAT, [
        {"role": "system", "content": "Continue the conversation."},
        {"role": "user", "content": words(rng, LONG_CHAT.prompt_tokens - 20)}])))
    out.sort(key=lambda a: a.at)
    return out


def turn_body(a: Arrival, history: list[dict], turn: int) -> dict:
    """Turn `turn` of a session: the system prompt, every earlier turn and its reply, the new question."""
    return body(INTERACTIVE, [{"role": "system", "content": a.system}, *history,
                              {"role": "user", "content": a.turn_texts[turn]}])
