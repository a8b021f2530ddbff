"""What a mask or causality audit found, and how it reads (docs/audit.md).

Notation: ``T`` positions; a pair ``(query, key)`` is (the position whose output changed, the
position whose token was perturbed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from dikkat.core.masks import (
    And,
    Causal,
    DenseMask,
    Document,
    Full,
    Mask,
    Not,
    Or,
    Padding,
    PrefixLM,
    SlidingWindow,
)

Pair = tuple[int, int]  # (query position, key position)

GRID_MAX = 32  # __str__ draws the query × key grid up to this many positions


class Report(Protocol):
    """What every audit returns: a verdict, a name, a line, what it tested and a readable
    account."""

    name: str

    @property
    def ok(self) -> bool: ...

    def summary(self) -> str: ...

    def coverage(self) -> str: ...


def describe(mask: Mask) -> str:
    """A dikkat mask as the expression that builds it: ``causal() & document(ids)``."""
    simple = {Causal: "causal()", Full: "full()", Document: "document(ids)"}
    if type(mask) in simple:
        return simple[type(mask)]
    if isinstance(mask, SlidingWindow):
        return f"sliding_window({mask.window})"
    if isinstance(mask, Padding):
        return "padding(lengths)" if mask.lengths is not None else "padding(valid=…)"
    if isinstance(mask, PrefixLM):
        n = mask.prefix_len.tolist()
        return f"prefix_lm({n[0] if len(n) == 1 else n})"
    if isinstance(mask, And):
        return f"{describe(mask.left)} & {describe(mask.right)}"
    if isinstance(mask, Or):
        return f"({describe(mask.left)} | {describe(mask.right)})"
    if isinstance(mask, Not):
        return f"~({describe(mask.inner)})"
    if isinstance(mask, DenseMask):
        return f"a bool tensor {tuple(mask.tensor.shape)}"
    return type(mask).__name__


def pairs(where: Tensor) -> tuple[Pair, ...]:
    """The True entries of a (T, T) bool matrix as sorted (query, key) pairs."""
    return tuple((int(i), int(j)) for i, j in where.nonzero().tolist())


@dataclass(frozen=True)
class Checked:
    """What a mask audit tested, and the tolerance it judged by."""

    batch: int  # B, the rows of random tokens (one call may hold copies of them per value)
    seq_len: int  # T
    trials: int  # fresh random rows, each key set to every value of its set in each
    forward_passes: int  # calls of the model, value sweep and Jacobian together
    rows_per_call: int  # the most rows one call held (values' rows stacked when the model can)
    jacobian: str  # where the gradients were taken, or why they were not
    rtol: float  # a change counts above rtol × the output's dependence on what it may see
    values: int  # token ids each key took in each trial (all of them when = vocab_size)
    vocab_size: int
    precision: str  # the dtype the probes ran in, and whether on a copy of the model

    @property
    def every_value(self) -> bool:
        """Each key took every token id (in every row of every trial)."""
        return self.values == self.vocab_size

    def varied(self) -> str:
        """What the tokens were put through, in words."""
        rows = (
            f"in each of {self.trials} trials × {self.batch} random rows of {self.seq_len} tokens"
        )
        if self.every_value:
            return f"each key set to every one of the {self.vocab_size} token ids, {rows}"
        share = 100 * self.values / self.vocab_size
        return (
            f"each key set to {self.values} of the {self.vocab_size} token ids ({share:.2g}%, "
            f"drawn afresh for each key and trial), {rows}"
        )

    def tolerance(self) -> str:
        """The tolerance, in words."""
        return (
            f"a move counts above {self.rtol:g} × that output's own dependence on the tokens "
            "its mask shows it (each position and output feature apart)"
        )

    def __str__(self) -> str:
        return (
            f"{self.varied()}; {self.forward_passes} calls of the model (up to "
            f"{self.rows_per_call} rows each) in {self.precision}"
        )


@dataclass(frozen=True, eq=False)
class MaskReport:
    """The (query, key) pairs a model reads, against those its declared mask allows.

    Attributes:
        name: the audit, ``"causality"`` or ``"mask"``.
        declared: the mask the outputs were checked against, as code (``causal()``).
        allowed: (T, T) bool, True where the mask lets the query see the key (in some row).
        read: (T, T) bool, True where the query's output moved with the key (in some row), by
            perturbation or by gradient.
        leaks: sorted (query, key) pairs whose output changed with the key (perturbation) or
            has a nonzero gradient with respect to its embedding (Jacobian), where no path of
            the mask (the ``hops`` of :func:`dikkat.audit.mask`) leads from key to query.
        jacobian_leaks: those of ``leaks`` the Jacobian found (empty when it was skipped).
        unread: allowed pairs no perturbation ever changed: a warning, not a failure (a
            random model may ignore a key by chance; more trials tell).
        checked: what was tested: the token values each key took, the dtype the probes ran
            in, the tolerance.
    """

    name: str
    declared: str
    allowed: Tensor
    read: Tensor
    leaks: tuple[Pair, ...]
    jacobian_leaks: tuple[Pair, ...]
    unread: tuple[Pair, ...]
    checked: Checked

    @property
    def ok(self) -> bool:
        """No leak (unread pairs are only warned about)."""
        return not self.leaks

    @property
    def first_leak(self) -> Pair | None:
        """The leak of the earliest query (and of its earliest key), or None."""
        return self.leaks[0] if self.leaks else None

    def summary(self) -> str:
        """One line: the verdict, the first leak named."""
        if self.leaks:
            q, k = self.leaks[0]
            return (
                f"LEAK: the output at position {q} depends on the token at {k}, which "
                f"{self.declared} hides from it ({len(self.leaks)} leaking pairs)"
            )
        line = f"every output depends only on what {self.declared} allows"
        if self.unread:
            line += f" (warning: {len(self.unread)} allowed pairs never read)"
        return line

    def coverage(self) -> str:
        """One line: what was varied, in which dtype, and the tolerance."""
        c = self.checked
        return f"{c.varied()}; in {c.precision}; {c.tolerance()}"

    def grid(self) -> str:
        """The query × key grid: ``#`` allowed and read, ``+`` read through other positions
        (over layers, or the position's own token), ``.`` hidden and unread, ``X`` leak, ``?``
        allowed but never read."""
        T = self.allowed.shape[0]
        marks = [
            ["#" if a else "+" if r else "." for a, r in zip(arow, rrow, strict=True)]
            for arow, rrow in zip(self.allowed.tolist(), self.read.tolist(), strict=True)
        ]
        for q, k in self.unread:
            marks[q][k] = "?"
        for q, k in self.leaks:
            marks[q][k] = "X"
        head = "".join(str(k % 10) for k in range(T))
        lines = [f"  query\\key {head}"] + [f"  {q:>9} {''.join(marks[q])}" for q in range(T)]
        return "\n".join(lines)

    def __str__(self) -> str:
        leaks = ", ".join(f"{q}←{k}" for q, k in self.leaks[:8])
        more = f", … ({len(self.leaks)} in all)" if len(self.leaks) > 8 else ""
        unread = ", ".join(f"{q}←{k}" for q, k in self.unread[:8])
        rows = [
            f"{self.name} audit against {self.declared}: {'ok' if self.ok else 'FAILED'}",
            f"  result    {self.summary()}",
            f"  checked   {self.checked}",
            f"  tolerance {self.checked.tolerance()}",
            f"  jacobian  {self.checked.jacobian}",
            f"  leaks     {leaks + more if leaks else 'none'}",
            f"  unread    {unread + (' …' if len(self.unread) > 8 else '') if unread else 'none'}",
        ]
        if (self.leaks or self.unread) and self.allowed.shape[0] <= GRID_MAX:
            rows.append(self.grid())
        return "\n".join(rows)
