"""The engine: iteration-level continuous batching of a GPT over a paged KV cache.

Notation: ``B`` running sequences, ``S`` slots attended, ``V`` vocabulary.

Requests join and leave the running batch between iterations (Orca's iteration-level
scheduling: Yu et al., "Orca: A Distributed Serving System for Transformer-Based Generative
Models", OSDI 2022). One :meth:`Engine.step` admits the waiting requests that fit, runs each
one's prompt through the model (the prefill, after the prompt blocks found in the prefix cache),
then runs ONE forward over every running sequence: each feeds its last token, at its own
position, against its own cached keys (gathered from the paged pool into one left-padded view
behind a padding mask, :mod:`dikkat.serving.paged`). Decoding is bound by reading the weights,
and that forward reads them once for the whole batch.

Exactness: nothing of one row reaches another (the padding mask hides the other rows' slots,
the positions are each row's own), each request samples with its own generator, so its tokens
are those of :func:`dikkat.generation.generate` for its prompt alone, up to rounding (a batched
product may round differently from a one-row product).

Memory: a request is admitted only when the blocks for its whole length (prompt + ``max_tokens``
− 1 slots, less the prefix blocks it shares) can be promised to it; it takes them as it grows and
gives them back when it ends. So a running request never waits for memory and is never
preempted; a request that does not fit waits in the queue, first come first served.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dikkat.layers.inference import inference_model
from dikkat.layers.quantized import WeightFormat, check_weights
from dikkat.models.gpt import GPT
from dikkat.serving.forward import decode, next_tokens, prefill
from dikkat.serving.paged import BlockAllocator, PagedKVPool, prefix_hashes
from dikkat.serving.requests import (
    EngineFull,
    EngineStats,
    FinishReason,
    SamplingParams,
    TokenEvent,
)
from dikkat.validate import check_int, is_int


@dataclass(eq=False)
class _Sequence:
    """One request inside the engine."""

    id: int
    tokens: list[int]  # the prompt, then the tokens generated so far
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator | None
    blocks: list[int] = field(default_factory=list)  # block table
    cached: int = 0  # tokens whose keys and values are in the blocks
    reserved: int = 0  # blocks promised for later tokens, not yet taken
    finish: FinishReason | None = None
    aborted: bool = False

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


class Engine:
    """Serves many generation requests on one :class:`~dikkat.models.GPT` at once.

    Args:
        model: the model. The engine serves an inference copy of it made here
            (:func:`dikkat.layers.inference_model`, in eval mode): the weights as they are now;
            changes to the model afterwards (training, ``load_state_dict``) do not reach it.
        block_size: slots per cache block.
        num_blocks: blocks in the pool; None: enough for ``max_batch`` sequences of the model's
            whole context.
        max_batch: sequences running at once.
        max_queue: requests waiting at once; :meth:`submit` raises :class:`EngineFull` past it.
        weights: the format the copy's linear layers hold their weights in, "fp32", "bf16",
            "int8" or "w8a8" (with ``batched=True`` when ``max_batch > 2``); the model's own
            parameters are not changed.

    Threads: :meth:`submit`, :meth:`abort`, :meth:`stats` and :meth:`has_work` may be called
    from any thread while another runs :meth:`step` (a lock guards the queues and the block
    allocator; the model work of a step runs outside it). Steps themselves run one at a time.
    Aborting a running request while a step runs frees its blocks when that step ends, and that
    step returns no event of it.

    >>> from dikkat.models import GPTConfig
    >>> engine = Engine(GPT(GPTConfig(max_len=32)).eval(), block_size=4)
    >>> rid = engine.submit([1, 2, 3], SamplingParams(max_tokens=2))
    >>> events = [e for _ in range(2) for e in engine.step()]
    >>> [e.finish_reason for e in events], engine.has_work()
    ([None, 'length'], False)
    """

    def __init__(
        self,
        model: GPT,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_batch: int = 16,
        max_queue: int = 64,
        weights: WeightFormat = "fp32",
    ) -> None:
        if not isinstance(model, GPT):
            raise TypeError(f"model must be a dikkat GPT, got {type(model).__name__}")
        check_int("block_size", block_size)
        check_int("num_blocks", num_blocks, optional=True)
        check_int("max_batch", max_batch)
        check_int("max_queue", max_queue)
        self.weights: WeightFormat = check_weights("weights", weights)
        c = model.config
        self._model = model
        # what the steps run: a snapshot, so the prefix cache's blocks always match its weights
        snapshot = inference_model(model, self.weights, batched=max_batch > 2)
        self._inference: GPT = snapshot  # type: ignore[assignment]
        self.max_len: int = c.max_len
        self.block_size, self.max_batch, self.max_queue = block_size, max_batch, max_queue
        if num_blocks is None:
            num_blocks = max_batch * self._blocks_for(c.max_len)
        weight = model.tok_emb.weight
        self._device = weight.device
        self._pool = PagedKVPool(
            c.n_layers,
            num_blocks,
            block_size,
            c.block().kv_heads,
            c.d_model // c.n_heads,
            dtype=weight.dtype,
            device=weight.device,
        )
        self._blocks = BlockAllocator(num_blocks)
        self._lock = threading.Lock()  # queues, allocator, counters
        self._step_lock = threading.Lock()  # one step at a time
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._reserved = 0  # blocks promised to running sequences, not yet taken
        self._in_step = False
        self._next_id = 0
        self._counts = dict.fromkeys(
            ("prompt_tokens", "generated_tokens", "finished", "aborted", "prefix_hit_tokens"), 0
        )

    @property
    def model(self) -> GPT:
        return self._model

    @property
    def num_blocks(self) -> int:
        return self._blocks.num_blocks

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # --- the public calls ----------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], params: SamplingParams) -> int:
        """Queue a request; returns its id (the ``request_id`` of its events)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        tokens = self._check_prompt(prompt)
        n, m = len(tokens), params.max_tokens
        if n + m > self.max_len:
            raise ValueError(
                f"the prompt has {n} tokens and max_tokens={m}: {n + m} positions, past the "
                f"model's context of {self.max_len}"
            )
        V = self._model.config.vocab_size
        for token in params.stop_ids:
            if token >= V:
                raise ValueError(f"stop_ids holds {token}, outside the vocabulary of {V}")
        need = self._blocks_for(n + m - 1)
        if need > self.num_blocks:
            raise ValueError(
                f"the prompt ({n} tokens) and max_tokens={m} need {need} blocks of "
                f"{self.block_size} slots, more than the engine's num_blocks={self.num_blocks}"
            )
        generator = None
        if params.seed is not None:  # as generate() seeds it: on the logits' device
            generator = torch.Generator(device=self._device).manual_seed(params.seed)
        with self._lock:
            if len(self._waiting) >= self.max_queue:
                raise EngineFull(
                    f"{len(self._waiting)} requests are waiting already (max_queue="
                    f"{self.max_queue}); try again later"
                )
            rid, self._next_id = self._next_id, self._next_id + 1
            self._waiting.append(_Sequence(rid, tokens, n, params, generator))
        return rid

    def abort(self, request_id: int) -> None:
        """Drop a waiting or running request and free its blocks; any other id is ignored."""
        with self._lock:
            for seq in self._waiting:
                if seq.id == request_id:
                    self._waiting.remove(seq)
                    self._counts["aborted"] += 1
                    return
            for seq in self._running:
                if seq.id == request_id and not seq.aborted:
                    seq.aborted = True
                    self._counts["aborted"] += 1
                    if not self._in_step:
                        self._end(seq)
                    return

    def has_work(self) -> bool:
        """Whether a request waits or runs (then :meth:`step` has something to do)."""
        with self._lock:
            return bool(self._waiting or self._running)

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(
                running=sum(not s.aborted for s in self._running),
                waiting=len(self._waiting),
                free_blocks=self._blocks.free_count,
                total_blocks=self.num_blocks,
                block_size=self.block_size,
                **self._counts,
            )

    def step(self) -> list[TokenEvent]:
        """One iteration: admit and prefill the waiting requests that fit, then one batched
        decode step for every running request. Returns this iteration's events; the requests
        that ended give back their blocks. If the model raises, every request in the engine is
        dropped (counted aborted) and the error propagates."""
        with self._step_lock:
            with self._lock:
                self._in_step = True
                admitted = self._admit()
                running = list(self._running)
            try:
                events = self._run(admitted, running)
            except BaseException:
                with self._lock:
                    self._drop_everything()
                raise
            with self._lock:
                return self._finish_step(events)

    # --- inside a step ---------------------------------------------------------------------------

    def _admit(self) -> list[_Sequence]:
        """Move the waiting requests that fit (in order, stopping at the first that does not)
        to the running batch, with their prompt blocks: shared prefix blocks, then new ones."""
        admitted = []
        P, alloc = self.block_size, self._blocks
        while self._waiting and len(self._running) < self.max_batch:
            seq = self._waiting[0]
            keys = prefix_hashes(seq.tokens, P)
            shared = []
            for key in keys[: (seq.prompt_len - 1) // P]:  # the last token is always computed
                block = alloc.lookup(key)
                if block is None:
                    break
                shared.append(block)
            total = self._blocks_for(seq.prompt_len + seq.params.max_tokens - 1)
            revived = sum(alloc.is_evictable(b) for b in shared)  # they stop counting as free
            if alloc.free_count - revived - self._reserved < total - len(shared):
                break
            self._waiting.popleft()
            for block in shared:
                alloc.share(block)
            fresh = self._blocks_for(seq.prompt_len) - len(shared)
            seq.blocks = shared + [alloc.allocate() for _ in range(fresh)]
            for block, key in zip(seq.blocks, keys, strict=False):
                alloc.register(block, key)  # written by the prefill below, before any reader
            seq.cached = len(shared) * P
            seq.reserved = total - len(seq.blocks)
            self._reserved += seq.reserved
            self._counts["prompt_tokens"] += seq.prompt_len
            self._counts["prefix_hit_tokens"] += seq.cached
            self._running.append(seq)
            admitted.append(seq)
        return admitted

    def _run(self, admitted: list[_Sequence], running: list[_Sequence]) -> list[TokenEvent]:
        """The model work of a step (outside the lock): the prefills, then one decode forward."""
        if not running:
            return []
        events = []
        for seq in admitted:
            logits = prefill(self._inference, self._pool, seq.tokens, seq.blocks, seq.cached)
            seq.cached = seq.prompt_len
            events += self._emit([seq], logits)
        decoding = [s for s in running if s.finish is None and not s.aborted]
        if decoding:
            with self._lock:
                for seq in decoding:
                    self._take_block_for(seq)
            logits = decode(
                self._inference,
                self._pool,
                [s.tokens[-1] for s in decoding],
                [s.cached for s in decoding],
                [s.blocks for s in decoding],
            )
            for seq in decoding:
                seq.cached += 1
            events += self._emit(decoding, logits)
        return events

    def _take_block_for(self, seq: _Sequence) -> None:
        """A block for the slot the next token's keys go to, if the table has none (taken from
        the sequence's promised blocks)."""
        if seq.cached == len(seq.blocks) * self.block_size:
            seq.blocks.append(self._blocks.allocate())
            seq.reserved -= 1
            self._reserved -= 1

    def _emit(self, seqs: list[_Sequence], logits: Tensor) -> list[TokenEvent]:
        """Each sequence's next token from its row of ``logits``, recorded as an event."""
        picked = next_tokens(logits, [s.params for s in seqs], [s.generator for s in seqs])
        events = []
        for seq, token in zip(seqs, picked, strict=True):
            seq.tokens.append(token)
            if token in seq.params.stop_ids:
                seq.finish = "stop"
            elif seq.generated == seq.params.max_tokens:
                seq.finish = "length"
            events.append(TokenEvent(seq.id, token, seq.finish))
        return events

    def _finish_step(self, events: list[TokenEvent]) -> list[TokenEvent]:
        """Under the lock: end what finished or was aborted, drop the aborted's events."""
        dropped = {s.id for s in self._running if s.aborted}
        for seq in list(self._running):
            if seq.aborted or seq.finish is not None:
                if not seq.aborted:
                    self._counts["finished"] += 1
                self._end(seq)
        events = [e for e in events if e.request_id not in dropped]
        self._counts["generated_tokens"] += len(events)
        self._in_step = False
        return events

    def _end(self, seq: _Sequence) -> None:
        """Remove a running sequence and give back its blocks (the last first: a cached prefix
        is evicted from its end, so its beginning stays reusable longer)."""
        self._running.remove(seq)
        for block in reversed(seq.blocks):
            self._blocks.release(block)
        self._reserved -= seq.reserved
        seq.blocks, seq.reserved = [], 0

    def _drop_everything(self) -> None:
        """After a failed step: every request is dropped and the prefix index forgotten (a block
        indexed during the step may never have been written)."""
        self._counts["aborted"] += len(self._waiting) + sum(not s.aborted for s in self._running)
        self._waiting.clear()
        self._running.clear()
        self._blocks = BlockAllocator(self.num_blocks)
        self._reserved = 0
        self._in_step = False

    def _check_prompt(self, prompt: object) -> list[int]:
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise TypeError(f"prompt must be a list of int token ids, got {type(prompt).__name__}")
        if len(prompt) == 0:
            raise ValueError("prompt is empty: a request needs at least one token")
        V = self._model.config.vocab_size
        for i, token in enumerate(prompt):
            if not is_int(token):
                raise TypeError(f"prompt[{i}] is {token!r} ({type(token).__name__}), not an int")
            if not 0 <= token < V:
                raise ValueError(f"prompt[{i}] is {token}, outside the vocabulary of {V}")
        return [int(t) for t in prompt]
