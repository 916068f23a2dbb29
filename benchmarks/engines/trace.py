"""The multi-turn trace of benchmarks/workload, cut to a size real CPU engines can serve.

``engine_trace(mix, seed)`` draws the same kinds of sessions as the workload
benchmark (chats on shared system prompts that come back, agents re-reading
a growing context, one-off prompts) and maps their token ids into the bench
model's vocabulary. Each request is served by one of two engines: engine A
takes the first half of the trace in time order, engine B the second half,
so B takes over sessions A started (a load balancer moving users, a restart,
a scale-out) and can only reuse their prefixes through an external cache.

Answers are the engine's own, as in a chat server: a request generates as
many tokens as the generator drew for its answer (capped by the run's
``--answer-tokens``, since decoding is slow on a CPU), and the session's
next request is its prompt and that generated answer, then the generator's
new tokens (the user's next message, a tool's result). So the KV of an
answer is in the engine that generated it and, with a connector that saves
decode blocks, in the cache, as it would be in production. ``parent`` names
the request whose prompt and answer begin this one; ``new`` holds the tokens
after them. ``prompt`` is the generator's prompt (with its drawn answers):
a request's prompt as served depends on what the engines generated, and is
known only when the request is sent (``run.resolve``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from benchmarks.workload.generator import Lognormal, Mix, generate

SPECIAL = 3  # the bench model's <unk>, <s>, </s>
VOCAB = 1024


@dataclass(frozen=True)
class EngineRequest:
    """One request: its id, the engine that serves it ("A" or "B"), whether its session
    was seen before (a returning session), the generator's prompt token ids, and: the
    request whose prompt and generated answer begin this prompt (``parent``, None: none),
    the tokens after them (``new``; None: the whole ``prompt``), and the answer's length
    the generator drew (``answer``, 0: none drawn)."""

    id: str
    engine: str
    session: int
    returning: bool
    prompt: list[int]
    parent: str | None = None
    new: list[int] | None = None
    answer: int = 0

    def as_json(self, answer_tokens: int) -> dict[str, object]:
        """The request for ``engine.py``: ``answer_tokens`` caps the tokens generated."""
        return {"id": self.id, "parent": self.parent,
                "prompt_token_ids": self.prompt if self.new is None else self.new,
                "max_tokens": min(self.answer, answer_tokens) if self.answer else answer_tokens}


def engine_mix(sessions: int, max_context: int) -> Mix:
    """The workload mix with prompts long enough that prefill dominates on a CPU engine.

    Sessions start within the first minute and come back minutes later (turns and agent
    steps 400 s and 200 s apart on average), so engine A's half of the trace holds their
    first requests and engine B, taking the second half, continues sessions A started."""
    return Mix(sessions=sessions, system_prompts=3, system_len=Lognormal(1000, 0.4, 256, 3000),
               turn_p=0.4, max_turns=4, user_len=Lognormal(120, 0.8, 8, 1024),
               answer_len=Lognormal(200, 0.6, 16, 1024), tool_prompts=2,
               tool_len=Lognormal(1500, 0.3, 256, 3000), agent_steps=(2, 4),
               tool_result_len=Lognormal(300, 0.8, 16, 2048), oneoff_len=Lognormal(1500, 0.6, 64, 4096),
               span_s=60.0, think_s=400.0, step_s=200.0, max_context=max_context)


def to_vocab(tokens: object) -> list[int]:
    """Token ids of the workload (below 128,000) as ids of the bench model (3..1023)."""
    return [int(t) % (VOCAB - SPECIAL) + SPECIAL for t in tokens]  # type: ignore[attr-defined]


def engine_trace(sessions: int, seed: int, max_context: int = 8192) -> list[EngineRequest]:
    """The trace in time order, each request assigned to engine A (first half) or B."""
    trace = generate(engine_mix(sessions, max_context), seed)
    last: dict[int, tuple[str, int]] = {}  # session -> (its last request's id, prompt + answer tokens)
    out = []
    half = len(trace) // 2
    for i, r in enumerate(trace):
        rid = f"r{i:03d}-s{r.session}"
        parent, new = None, None
        if r.session in last:  # the generator's next prompt begins with the last prompt and answer
            parent, held = last[r.session]
            new = to_vocab(r.prompt[held:])
        out.append(EngineRequest(rid, "A" if i < half else "B", r.session, r.session in last,
                                 to_vocab(r.prompt), parent, new, int(r.answer_tokens.size)))
        last[r.session] = (rid, int(r.prompt.size + r.answer_tokens.size))
    return out


def block_chain(tokens: list[int], block: int) -> list[bytes]:
    """The prefix digest of each whole block of ``block`` tokens in ``tokens``: equal digests
    mean equal blocks after equal prefixes, as a KV cache keys them."""
    h = hashlib.blake2b(digest_size=16)
    out = []
    for i in range(len(tokens) // block):
        h.update(bytes(str(tokens[i * block:(i + 1) * block]), "ascii"))
        out.append(h.copy().digest())
    return out


def distinct_blocks(trace: list[EngineRequest], block: int) -> int:
    """Whole KV blocks of ``block`` tokens that differ by their prefix, over every prompt:
    the bytes a cache needs to hold everything the trace could reuse."""
    return len({d for r in trace for d in block_chain(r.prompt, block)})


def reusable_tokens(served: list[tuple[list[int], list[int]]], block: int) -> list[int]:
    """The most any KV cache could supply of each request's prompt, the engine's own included.

    ``served`` holds, in the order the requests ran, each one's prompt as sent and the
    tokens it generated. A request may reuse the leading whole blocks of its prompt that
    some request before it computed (that one's prompt and all but its last generated
    token, whose KV is never computed), and never its own last prompt token, which the
    engine computes to sample the first answer token. With one request at a time this is
    the ceiling of the ``cached`` share every system's engines can reach."""
    seen: set[bytes] = set()
    out = []
    for prompt, answer in served:
        found = 0
        for d in block_chain(prompt, block):
            if d not in seen:
                break
            found += 1
        out.append(max(0, min(found * block, len(prompt) - 1)))
        seen.update(block_chain(list(prompt) + list(answer[:-1]), block))
    return out
