"""A seeded generator of multi-turn LLM traffic, as token sequences.

No dataset can be downloaded here, so the traffic is drawn from stated
distributions that follow what is published about ShareGPT-style chat logs
(a few turns per conversation, user turns of some tens to a few hundred
tokens, answers a few times longer) plus the two patterns a KV-cache pool is
built for: system prompts shared by many users, and agent loops that re-read
a growing context on every step. Every parameter is a field of ``Mix`` below;
the same seed always gives the same trace (tokens included).

Sessions, each started at a uniform time over the trace's span:

- chat (``Mix.chat``): one of ``system_prompts`` shared system prompts
  (lognormal length, Zipf popularity), then ``Geometric(turn_p)`` turns (1, 2, ...; mean 1 / p)
  (capped); each turn a user message (lognormal) and an answer (lognormal).
  Request k's prompt is the system prompt and every earlier message and
  answer, then user message k. Think time between turns: exponential.
- agent (``Mix.agent``): one of ``tool_prompts`` shared tool specifications,
  a task, then ``agent_steps`` steps; each step re-reads the whole context
  and appends an action and a tool result (both lognormal). Short gaps.
- one-off (the rest): one request with a prompt of its own (lognormal), no
  shared prefix; never seen again.

A ``Request`` carries its prompt tokens and the number of answer tokens; the
replay saves the KV of prompt + answer (what an engine holds at the end of
the request) and the next turn's prompt starts with exactly those tokens.
Contexts are capped at ``max_context`` tokens (the session ends there).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

VOCAB = 128_000  # Llama-3's vocabulary size: token ids are drawn below it


@dataclass(frozen=True)
class Lognormal:
    """Token length ``round(median * exp(sigma * N(0,1)))`` clipped to [lo, hi]."""

    median: float
    sigma: float
    lo: int = 1
    hi: int = 8192

    def draw(self, rng: np.random.Generator, n: int | None = None) -> np.ndarray:
        x = np.rint(self.median * np.exp(self.sigma * rng.standard_normal(n if n is not None else 1)))
        return np.clip(x, self.lo, self.hi).astype(np.int64)

    @property
    def mean(self) -> float:
        """Mean before clipping: median * exp(sigma**2 / 2)."""
        return float(self.median * np.exp(self.sigma ** 2 / 2))


@dataclass(frozen=True)
class Mix:
    """Every parameter of the traffic (ShareGPT-like chat, shared prompts, agents, one-offs)."""

    sessions: int = 300
    chat: float = 0.60  # fractions of sessions; the rest (0.15) are one-offs
    agent: float = 0.25
    system_prompts: int = 8
    system_len: Lognormal = Lognormal(400, 0.5, 64, 2048)
    system_zipf: float = 1.1  # popularity of system prompt i ~ 1 / (i + 1) ** s
    turn_p: float = 0.35  # turns ~ Geometric(p) on 1, 2, ... (mean 1 / p ~ 2.9), capped
    max_turns: int = 20
    user_len: Lognormal = Lognormal(60, 1.0, 4, 2048)  # mean ~ 99 tokens
    answer_len: Lognormal = Lognormal(200, 0.8, 8, 1024)  # mean ~ 275 tokens
    think_s: float = 300.0  # mean gap between a chat's turns (exponential): users come back
    tool_prompts: int = 4
    tool_len: Lognormal = Lognormal(1500, 0.3, 256, 4096)
    task_len: Lognormal = Lognormal(150, 0.7, 8, 2048)
    agent_steps: tuple[int, int] = (4, 24)  # uniform, inclusive
    action_len: Lognormal = Lognormal(60, 0.6, 4, 512)
    tool_result_len: Lognormal = Lognormal(300, 1.0, 8, 4096)
    step_s: float = 30.0  # mean gap between an agent's steps (a tool call, a model call)
    oneoff_len: Lognormal = Lognormal(300, 1.0, 8, 8192)
    oneoff_answer: Lognormal = Lognormal(200, 0.8, 8, 1024)
    span_s: float = 900.0  # sessions start uniformly over this span
    max_context: int = 32_768


@dataclass(frozen=True)
class Request:
    """One prefill: ``prompt`` token ids, then ``answer`` generated tokens.

    ``answer_tokens`` are the ids generated (known in advance so the next
    turn can quote them); ``kind`` is "chat", "agent" or "oneoff".
    """

    time: float
    session: int
    kind: str
    prompt: np.ndarray = field(repr=False)
    answer_tokens: np.ndarray = field(repr=False)

    @property
    def sequence(self) -> np.ndarray:
        """Prompt + answer: the tokens whose KV the engine holds at the end."""
        return np.concatenate([self.prompt, self.answer_tokens])


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB, int(n), dtype=np.int64)


def _zipf_pick(rng: np.random.Generator, n: int, s: float) -> int:
    w = 1.0 / np.arange(1, n + 1) ** s
    return int(rng.choice(n, p=w / w.sum()))


def generate(mix: Mix, seed: int) -> list[Request]:
    """The trace of ``mix`` for ``seed``, in time order (ties by session)."""
    rng = np.random.default_rng(seed)
    systems = [_tokens(rng, mix.system_len.draw(rng)[0]) for _ in range(mix.system_prompts)]
    tools = [_tokens(rng, mix.tool_len.draw(rng)[0]) for _ in range(mix.tool_prompts)]
    out: list[Request] = []
    for s in range(mix.sessions):
        start = float(rng.uniform(0, mix.span_s))
        u = rng.random()
        if u < mix.chat:
            out += _chat(rng, mix, s, start, systems)
        elif u < mix.chat + mix.agent:
            out += _agent(rng, mix, s, start, tools)
        else:
            prompt = _tokens(rng, mix.oneoff_len.draw(rng)[0])
            out.append(Request(start, s, "oneoff", prompt, _tokens(rng, mix.oneoff_answer.draw(rng)[0])))
    out.sort(key=lambda r: (r.time, r.session))
    return out


def _chat(rng: np.random.Generator, mix: Mix, s: int, t: float,
          systems: list[np.ndarray]) -> list[Request]:
    context = systems[_zipf_pick(rng, mix.system_prompts, mix.system_zipf)]
    turns = min(mix.max_turns, int(rng.geometric(mix.turn_p)))  # numpy's Geometric counts from 1
    out = []
    for _ in range(turns):
        prompt = np.concatenate([context, _tokens(rng, mix.user_len.draw(rng)[0])])
        if prompt.size > mix.max_context:
            break
        answer = _tokens(rng, mix.answer_len.draw(rng)[0])
        out.append(Request(t, s, "chat", prompt, answer))
        context = np.concatenate([prompt, answer])
        t += float(rng.exponential(mix.think_s))
    return out


def _agent(rng: np.random.Generator, mix: Mix, s: int, t: float,
           tools: list[np.ndarray]) -> list[Request]:
    context = np.concatenate([tools[_zipf_pick(rng, mix.tool_prompts, 1.0)],
                              _tokens(rng, mix.task_len.draw(rng)[0])])
    lo, hi = mix.agent_steps
    out = []
    for _ in range(int(rng.integers(lo, hi + 1))):
        if context.size > mix.max_context:
            break
        action = _tokens(rng, mix.action_len.draw(rng)[0])
        out.append(Request(t, s, "agent", context, action))
        context = np.concatenate([context, action, _tokens(rng, mix.tool_result_len.draw(rng)[0])])
        t += float(rng.exponential(mix.step_s))
    return out


def quick_mix() -> Mix:
    """A small trace for the quick mode and the tests (same shape, fewer sessions)."""
    return Mix(sessions=80, span_s=240.0)
