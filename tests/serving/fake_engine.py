"""A stand-in with :class:`dikkat.serving.Engine`'s interface, for the HTTP layer's tests: each
running request decodes through its own ``iter_generate`` (batch 1, its own KV cache), so its
tokens are ``generate``'s by construction; cache blocks are only counted (a request holds the
blocks its prompt and ``max_tokens`` need, from admission to its end)."""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from dikkat.generation import iter_generate
from dikkat.models import GPT
from dikkat.serving import EngineFull, EngineStats, SamplingParams, TokenEvent


@dataclass
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    blocks: int
    tokens: Iterator[torch.Tensor] | None = None
    generated: list[int] = field(default_factory=list)


class FakeEngine:
    def __init__(
        self,
        model: GPT,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_batch: int = 16,
        max_queue: int = 64,
    ) -> None:
        self.model = model.eval()
        self.max_len = model.config.max_len
        self.block_size, self.max_batch, self.max_queue = block_size, max_batch, max_queue
        self.total_blocks = num_blocks or max_batch * math.ceil(self.max_len / block_size)
        self.free_blocks = self.total_blocks
        self.waiting: deque[_Request] = deque()
        self.running: dict[int, _Request] = {}
        self.counts = dict(prompt_tokens=0, generated_tokens=0, finished=0, aborted=0)
        self.next_id = 0
        self.lock = threading.Lock()
        self.step_delay = 0.0  # seconds each step sleeps (tests that need a request to linger)

    def submit(self, prompt: list[int], params: SamplingParams) -> int:
        if not prompt or len(prompt) + params.max_tokens > self.max_len:
            raise ValueError(f"prompt of {len(prompt)} + {params.max_tokens} > {self.max_len}")
        with self.lock:
            if len(self.waiting) >= self.max_queue:
                raise EngineFull(f"{len(self.waiting)} requests wait (max_queue={self.max_queue})")
            self.next_id += 1
            blocks = math.ceil((len(prompt) + params.max_tokens) / self.block_size)
            self.waiting.append(_Request(self.next_id, list(prompt), params, blocks))
            return self.next_id

    def step(self) -> list[TokenEvent]:
        with self.lock:
            while (
                self.waiting
                and len(self.running) < self.max_batch
                and self.waiting[0].blocks <= self.free_blocks
            ):
                r = self.waiting.popleft()
                self.free_blocks -= r.blocks
                self.counts["prompt_tokens"] += len(r.prompt)
                p = r.params
                r.tokens = iter_generate(
                    self.model, [r.prompt], p.max_tokens,
                    temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed,
                )  # fmt: skip
                self.running[r.id] = r
            batch = list(self.running.values())
        if self.step_delay:
            threading.Event().wait(self.step_delay)
        events = []
        with torch.inference_mode():
            for r in batch:
                token = int(next(r.tokens)[0])
                r.generated.append(token)
                finish = None
                if token in r.params.stop_ids:
                    finish = "stop"
                elif len(r.generated) == r.params.max_tokens:
                    finish = "length"
                events.append(TokenEvent(r.id, token, finish))
        with self.lock:
            for r, e in zip(batch, events, strict=True):
                self.counts["generated_tokens"] += 1
                if e.finish_reason is not None and self.running.pop(r.id, None) is not None:
                    self.free_blocks += r.blocks
                    self.counts["finished"] += 1
            # a request aborted during the step above is already gone: drop its event
            return [e for e in events if e.finish_reason or e.request_id in self.running]

    def abort(self, request_id: int) -> None:
        with self.lock:
            r = self.running.pop(request_id, None)
            if r is not None:
                self.free_blocks += r.blocks
            else:
                kept = [w for w in self.waiting if w.id != request_id]
                if len(kept) == len(self.waiting):
                    return  # unknown or finished: nothing to do
                self.waiting = deque(kept)
            self.counts["aborted"] += 1

    def has_work(self) -> bool:
        with self.lock:
            return bool(self.waiting or self.running)

    def stats(self) -> EngineStats:
        with self.lock:
            return EngineStats(
                running=len(self.running),
                waiting=len(self.waiting),
                free_blocks=self.free_blocks,
                total_blocks=self.total_blocks,
                block_size=self.block_size,
                prefix_hit_tokens=0,
                **self.counts,
            )
