"""The engine: iteration-level continuous batching of a decoder over a paged KV cache.

Notation: ``B`` running sequences, ``S`` slots attended, ``V`` vocabulary.

Requests join and leave the running batch between iterations (Orca's iteration-level
scheduling: Yu et al., "Orca: A Distributed Serving System for Transformer-Based Generative
Models", OSDI 2022). One :meth:`Engine.step` admits the waiting requests that fit, runs each
one's prompt through the model (the prefill, after the prompt blocks found in the prefix cache),
then runs ONE forward over every running sequence: each feeds its last token, at its own
position, against its own cached keys (gathered from the paged pool into one left-padded view
behind a padding mask, :mod:`dikkat.serving.paged`). Decoding is bound by reading the weights,
and that forward reads them once for the whole batch.

The model is any decoder of :class:`dikkat.generation.DecoderLM` (``dikkat.models.GPT``, the
Llama / Gemma family of ``dikkat.models.Decoder``): the engine reads its cache layout and calls
its forward, nothing else.

Exactness: nothing of one row reaches another (the padding mask hides the other rows' slots,
the positions are each row's own), each request picks its tokens with its own
:class:`~dikkat.generation.Sampler` (generator, penalty counts), so its tokens are those of
:func:`dikkat.generation.generate` for its prompt alone, up to rounding (a batched product may
round differently from a one-row product).

Memory: a request is admitted when the blocks its prompt fills (less the prefix blocks it
shares) are free, and takes one more each time its last block fills, as vLLM does; it gives them
back when it ends. Where a running request's next token finds no free block, the request
admitted last is preempted: back to the front of the queue, its blocks given back, its prompt
and tokens prefilled again when it is admitted again, its tokens unchanged (docs/engine.md,
"Preemption"). A request that does not fit waits in the queue, first come first served.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

from dikkat.generation.constraint import Grammars, matcher_of
from dikkat.generation.protocol import DecoderLM
from dikkat.generation.sampler import Sampler
from dikkat.generation.sampling import SamplingParams
from dikkat.serving.failures import StepWork, decode_each, prefill_each
from dikkat.serving.forward import decode_rows
from dikkat.serving.paged import BlockAllocator, PagedKVPool, default_num_blocks, prefix_hashes
from dikkat.serving.requests import (
    EngineFull,
    EngineSequence,
    EngineStats,
    TokenEvent,
    batched_layouts,
    check_request,
    vocab_rows,
)
from dikkat.validate import check_bool, check_int
from dikkat.weights import InferenceLinear, inference_model
from dikkat.weights.formats import WeightFormat, check_weights


class Engine:
    """Serves many generation requests on one decoder at once.

    Args:
        model: a decoder of :class:`~dikkat.generation.DecoderLM` (``dikkat.models.GPT``,
            ``dikkat.models.Decoder``). The engine serves an inference copy of it made here
            (:func:`dikkat.weights.inference_model`, in eval mode): the weights as they are now;
            changes to the model afterwards (training, ``load_state_dict``) do not reach it.
        block_size: slots per cache block.
        num_blocks: blocks in the pool; None: enough for ``max_batch`` sequences of the model's
            whole context, or what fits in :data:`~dikkat.serving.paged.DEFAULT_CACHE_BYTES`
            if that is less (a real model's context of thousands of tokens would otherwise take
            many GiB).
        max_batch: sequences running at once.
        max_queue: requests waiting at once; :meth:`submit` raises :class:`EngineFull` past it.
        weights: the format the copy's linear layers hold their weights in, "fp32", "bf16",
            "int8", "w8a8", "q8" or "q4" (with ``batched=True`` when ``max_batch > 2``); None:
            the model's own if it is an inference copy already (a GGUF file's packed weights,
            :func:`dikkat.pretrained.load`), else "fp32". The model's own parameters are not
            changed.
        compile: decode through the model's compiled pool step (``model.pool_step``; a
            ``Decoder`` or a ``GPT``): on the CPU compiled ahead of time, once per model and
            machine, and loaded from dikkat's cache after
            (:class:`~dikkat.models.aot_step.AotPoolStep`), with the batch and the slots
            symbolic, so one package serves every batch; elsewhere, or where that cannot be
            built, through ``torch.compile`` in the first steps or :meth:`warm_up`. The
            prefills stay eager.
        grammars: compiles requests' constraints (``params.constraint``) for the tokenizer's
            vocabulary (:class:`~dikkat.generation.Grammars`); None: such requests are refused.

    Threads: :meth:`submit`, :meth:`abort`, :meth:`stats` and :meth:`has_work` may be called
    from any thread while another runs :meth:`step` (a lock guards the queues and the block
    allocator; the model work of a step runs outside it). Steps themselves run one at a time.
    Aborting a running request while a step runs frees its blocks when that step ends, and that
    step returns no event of it.

    >>> from dikkat.models import GPT, GPTConfig
    >>> engine = Engine(GPT(GPTConfig(max_len=32)).eval(), block_size=4)
    >>> rid = engine.submit([1, 2, 3], SamplingParams(max_new_tokens=2))
    >>> events = [e for _ in range(2) for e in engine.step()]
    >>> [e.finish_reason for e in events], engine.has_work()
    ([None, 'length'], False)
    """

    def __init__(
        self,
        model: DecoderLM,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_batch: int = 16,
        max_queue: int = 64,
        weights: WeightFormat | None = None,
        compile: bool = False,
        grammars: Grammars | None = None,
    ) -> None:
        if not isinstance(model, DecoderLM):
            raise TypeError(
                f"model must be a decoder (dikkat.generation.DecoderLM: a GPT, a Decoder), got "
                f"{type(model).__name__}"
            )
        check_int("block_size", block_size)
        check_int("num_blocks", num_blocks, optional=True)
        check_int("max_batch", max_batch)
        check_int("max_queue", max_queue)
        check_bool("compile", compile)
        if weights is not None:
            weights = check_weights("weights", weights)
        layout = model.cache_layout()
        self._model = model
        # what the steps run: a snapshot, so the prefix cache's blocks always match its weights
        # (a model that is an inference copy already, such as a GGUF file's packed weights, as
        # it is)
        snapshot = inference_model(model, weights, batched=batched_layouts(model, max_batch))  # type: ignore[arg-type]
        held = [m.weights_format for m in snapshot.modules() if isinstance(m, InferenceLinear)]
        self.weights: str = held[0] if held else "fp32"  # the format the steps multiply in
        self._inference: DecoderLM = snapshot  # type: ignore[assignment]
        self.max_len: int = layout.context
        # the ids its embedding holds: a header may claim more (and the step would fail on them)
        self.vocab_size: int = vocab_rows(snapshot, model.config.vocab_size)
        self.block_size, self.max_batch, self.max_queue = block_size, max_batch, max_queue
        if num_blocks is None:
            num_blocks = default_num_blocks(layout, block_size, max_batch, layout.context)
        self._pool = PagedKVPool(
            layout.n_layers,
            num_blocks,
            block_size,
            layout.kv_heads,
            layout.head_dim,
            dtype=layout.dtype,
            device=layout.device,
        )
        self._blocks = BlockAllocator(num_blocks)
        self._decode_step = None  # the compiled pool step, with compile=True
        if compile:  # DecoderLM's pool step
            self._decode_step = self._inference.pool_step(
                list(self._pool.k), list(self._pool.v), compile=True
            )
        self.grammars = grammars
        self._lock = threading.Lock()  # queues, allocator, counters
        self._step_lock = threading.Lock()  # one step at a time
        self._waiting: deque[EngineSequence] = deque()
        self._running: list[EngineSequence] = []
        self._in_step = False
        self._next_id = 0
        counts = "prompt_tokens generated_tokens finished aborted failed prefix_hit_tokens"
        counts += " preempted"
        self._counts = dict.fromkeys(counts.split(), 0)

    @property
    def model(self) -> DecoderLM:
        return self._model

    @property
    def num_blocks(self) -> int:
        return self._blocks.num_blocks

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # --- the public calls ----------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], params: SamplingParams) -> int:
        """Queue a request; returns its id (the ``request_id`` of its events).

        ``params.n`` must be 1 (submit each of ``params.choices()``) and ``params.stop`` empty
        (the engine works in token ids: whoever decodes the text matches stop strings). A
        constraint (``params.constraint``) is compiled by the engine's ``grammars``.
        """
        tokens = check_request(
            prompt, params, self.vocab_size, self.max_len, self.block_size, self.num_blocks
        )
        matcher = matcher_of(self.grammars, params.constraint, "Engine(grammars=...)")
        n, sampler = len(tokens), Sampler(params, [tuple(tokens)])  # (tokens grows later)
        with self._lock:
            if len(self._waiting) >= self.max_queue:
                raise EngineFull(
                    f"{len(self._waiting)} requests are waiting already (max_queue="
                    f"{self.max_queue}); try again later"
                )
            rid, self._next_id = self._next_id, self._next_id + 1
            self._waiting.append(EngineSequence(rid, tokens, n, params, sampler, matcher=matcher))
        return rid

    def abort(self, request_id: int) -> None:
        """Drop a waiting or running request and free its blocks; any other id is ignored."""
        self._drop(request_id, "aborted")

    def finish(self, request_id: int) -> None:
        """End a request early as :meth:`abort` does, counted as finished rather than aborted:
        whoever reads its text found a stop string in it."""
        self._drop(request_id, "finished")

    def _drop(self, request_id: int, counter: str) -> None:
        with self._lock:
            for seq in self._waiting:
                if seq.id == request_id:
                    self._waiting.remove(seq)
                    self._counts[counter] += 1
                    return
            for seq in self._running:
                if seq.id == request_id and not seq.aborted:
                    seq.aborted = True  # no more events; counted here, not when it ends
                    self._counts[counter] += 1
                    if not self._in_step:
                        self._end(seq)
                    return

    def warm_up(self) -> None:
        """Decode a one-token request alone, then two together, and forget them (on an idle
        engine): a compiled engine compiles its graphs here, not in its first requests."""
        with self._lock:
            if self._waiting or self._running:
                raise RuntimeError("warm_up() runs on an idle engine; requests are in it")
            counts = dict(self._counts)
        for rows in (1, 2):
            for _ in range(rows):
                self.submit([0], SamplingParams(max_new_tokens=2))
            while self.has_work():
                self.step()
        with self._lock:
            self._counts = counts

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
        that ended give back their blocks. A request the model raises for, or whose logits are
        not finite, ends alone with an error event (counted failed); if anything outside the
        model work raises, every request in the engine is dropped (counted aborted) and the
        error propagates (docs/engine.md, "When a request fails")."""
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

    def _admit(self) -> list[EngineSequence]:
        """Move the waiting requests that fit (in order, stopping at the first that does not)
        to the running batch, with the blocks of what their prefill writes — shared prefix
        blocks, then new ones — leaving a block for the next token of every running request
        that has filled its last one (so that admitting a request never preempts one at once).
        A request's later tokens take blocks as they come (:meth:`_make_room`)."""
        admitted = []
        P, alloc = self.block_size, self._blocks
        spare = sum(s.cached == len(s.blocks) * P for s in self._running)
        while self._waiting and len(self._running) < self.max_batch:
            seq = self._waiting[0]
            fed = seq.fed
            keys = prefix_hashes(seq.tokens[:fed], P)
            shared = []
            # the last token fed is always computed; every one, when its log-probability is asked
            every = seq.params.prompt_logprobs and not seq.generated
            reusable = 0 if every else (fed - 1) // P
            for key in keys[:reusable]:
                block = alloc.lookup(key)
                if block is None:
                    break
                shared.append(block)
            fresh = self._blocks_for(fed) - len(shared)
            full = fed % P == 0  # its first decoded token's keys start a block
            revived = sum(alloc.is_evictable(b) for b in shared)  # they stop counting as free
            if alloc.free_count - revived < fresh + spare + full:
                break
            self._waiting.popleft()
            for block in shared:
                alloc.share(block)
            seq.blocks = shared + [alloc.allocate() for _ in range(fresh)]
            for block, key in zip(seq.blocks, keys, strict=False):
                alloc.register(block, key)  # written by the prefill below, before any reader
            seq.cached = len(shared) * P
            spare += full
            if not seq.generated:  # (a preempted request's prompt was counted when it came)
                self._counts["prompt_tokens"] += seq.prompt_len
            self._counts["prefix_hit_tokens"] += seq.cached
            self._running.append(seq)
            admitted.append(seq)
        return admitted

    def _run(
        self, admitted: list[EngineSequence], running: list[EngineSequence]
    ) -> list[TokenEvent]:
        """The model work of a step (outside the lock): the prefills, then one decode forward,
        each failure pinned on its request (:mod:`dikkat.serving.failures`)."""
        if not running:
            return []
        work = StepWork()
        unwritten, recomputed = prefill_each(self._inference, self._pool, admitted, work)
        with self._lock:
            for block in unwritten:
                self._blocks.forget(block)
            self._counts["prefix_hit_tokens"] -= recomputed
        decoding = [s for s in running if s.finish is None and not s.aborted]
        if decoding:
            with self._lock:
                decoding = self._make_room(decoding)
            model, step, pool = self._inference, self._decode_step, self._pool
            decode_each(lambda rows: decode_rows(model, step, pool, rows), decoding, work)
        return work.events

    def _make_room(self, decoding: list[EngineSequence]) -> list[EngineSequence]:
        """A block for the slot each request's next token goes to, where its table has none,
        in the order they were admitted; where none is left, the request admitted last is
        preempted (:meth:`_preempt`) until one is. Returns the requests that decode now."""
        P, kept = self.block_size, list(decoding)
        for seq in decoding:
            if seq not in kept or seq.cached < len(seq.blocks) * P:
                continue
            while self._blocks.free_count == 0 and seq in kept:
                victim = kept.pop()  # the last admitted (it may be seq itself)
                self._preempt(victim)
            if seq in kept:
                seq.blocks.append(self._blocks.allocate())
        return kept

    def _preempt(self, seq: EngineSequence) -> None:
        """Take a running request back to the front of the queue, its blocks given back (its
        full prefix blocks stay in the prefix index, evictable): when it is admitted again, its
        prompt and the tokens it made are prefilled anew (what is still cached, shared) and it
        goes on where it stopped — its sampler, and so its draws, untouched (vLLM's
        preemption by recomputation)."""
        self._running.remove(seq)
        for block in reversed(seq.blocks):
            self._blocks.release(block)
        seq.blocks, seq.cached = [], 0
        self._waiting.appendleft(seq)
        self._counts["preempted"] += 1

    def _finish_step(self, events: list[TokenEvent]) -> list[TokenEvent]:
        """Under the lock: end what finished, failed or was aborted, drop the aborted's events."""
        dropped = {s.id for s in self._running if s.aborted}
        for seq in list(self._running):
            if seq.aborted or seq.finish is not None:
                if not seq.aborted:
                    self._counts["failed" if seq.finish == "error" else "finished"] += 1
                self._end(seq)
        events = [e for e in events if e.request_id not in dropped]
        self._counts["generated_tokens"] += sum(e.finish_reason != "error" for e in events)
        self._in_step = False
        return events

    def _end(self, seq: EngineSequence) -> None:
        """Remove a running sequence and give back its blocks (the last first: a cached prefix
        is evicted from its end, so its beginning stays reusable longer)."""
        self._running.remove(seq)
        for block in reversed(seq.blocks):
            self._blocks.release(block)
        seq.blocks = []

    def _drop_everything(self) -> None:
        """After a failed step: every request is dropped and the prefix index forgotten (a block
        indexed during the step may never have been written)."""
        self._counts["aborted"] += len(self._waiting) + sum(not s.aborted for s in self._running)
        self._waiting.clear()
        self._running.clear()
        self._blocks = BlockAllocator(self.num_blocks)
        self._in_step = False
