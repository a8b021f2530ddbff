"""What a family file declares: the :class:`Family` record, the table of its tensors' names
(:class:`Weight`, :class:`Tensors`), and the pre-split of its tokenizer (:class:`PreSplit`).

A family is data first, as an architecture is a row of llama.cpp's ``src/llama-arch.cpp``: its
names in each format, how a header or a ``config.json`` maps onto a dikkat config, the name of
each stored tensor, and what must be done to a tensor on the way in. The loader
(:mod:`dikkat.pretrained.loading`) reads a file through these and nothing else; the model
(:meth:`dikkat.models.generating.Generates.hold`) fuses and holds what it is handed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

__all__ = [
    "DIGITS_GPT2_SPLIT",
    "GPT2_SPLIT",
    "Family",
    "PreSplit",
    "Tensors",
    "Values",
    "Weight",
    "always",
    "as_stored",
    "never",
]

Config = Any  # a DecoderConfig or a GPTConfig: the family's model class takes it
# (name in dikkat's state dict, tensor, config) → the tensor in dikkat's layout
FixUp = Callable[[str, Tensor, Config], Tensor]
# a GGUF file's tensor by name, read as stored (a small one that configures the model)
Values = Callable[[str], Tensor]
# (header, the file's tensors: name → torch shape, their values, source) → config
FromGGUF = Callable[[Mapping[str, Any], Mapping[str, tuple[int, ...]], Values, str], Config]
FromHF = Callable[[dict[str, Any], str], Config]  # (config.json, source) → config


def always(config: Config) -> bool:
    return True


def never(config: Config) -> bool:
    return False


def as_stored(name: str, tensor: Tensor, config: Config) -> Tensor:
    """The fix-up of a format whose tensors are in dikkat's layout already."""
    return tensor


@dataclass(frozen=True)
class Weight:
    """One stored weight (and its bias, where ``bias`` says): dikkat's module path, and its name
    in a GGUF file and in an HF checkpoint (None: that format does not store it). In
    :attr:`Tensors.layer`, the paths are within a block: ``attn.q_proj`` is block i's
    ``blocks.{i}.attn.q_proj``, GGUF's ``blk.{i}.attn_q``, HF's
    ``model.layers.{i}.self_attn.q_proj``.

    ``when``: whether a model of the config has the weight at all (a q/k norm, an untied output
    layer); ``bias``: whether a ``.bias`` is stored beside the ``.weight``. A row whose names
    hold ``{e}`` is one weight of each expert of a mixture (``mlp.experts.{e}.gate``)."""

    ours: str
    gguf: str | None
    hf: str | None = None
    when: Callable[[Config], bool] = always
    bias: Callable[[Config], bool] = never


@dataclass(frozen=True)
class Tensors:
    """A family's tensor names: one table, from which each format's name map is derived."""

    model: tuple[Weight, ...]  # outside the blocks (embeddings, final norm, output layer)
    layer: tuple[Weight, ...]  # in every block
    gguf_block: str = "blk.{i}."  # llama.cpp's, for every architecture
    hf_block: str = "model.layers.{i}."  # transformers' decoder-only models
    ours_block: str = "blocks.{i}."

    def gguf(self, config: Config) -> dict[str, str]:
        """GGUF tensor name → dikkat name, for every tensor a file of ``config`` holds."""
        return self._names(config, "gguf", self.gguf_block)

    def hf(self, config: Config) -> dict[str, str]:
        """HF state-dict name → dikkat name, for every tensor a checkpoint of ``config`` holds."""
        return self._names(config, "hf", self.hf_block)

    def stores(self, ours: str) -> bool:
        """Whether a block's weight ``ours`` is stored under a GGUF name of its own."""
        return any(r.ours == ours and r.gguf is not None for r in self.layer)

    def gguf_name(self, ours: str, block: int | None = None, kind: str = "weight") -> str:
        """The GGUF name of weight (or ``kind="bias"``) ``ours``, in block ``block`` where
        given: what a config mapping holds the header's sizes to (``("tok_emb")`` →
        ``"token_embd.weight"``; ``("attn.q_proj", 0)`` → ``"blk.0.attn_q.weight"``)."""
        rows = self.model if block is None else self.layer
        row = next((r for r in rows if r.ours == ours), None)
        if row is None or row.gguf is None:
            raise KeyError(f"the table stores no GGUF tensor for {ours!r}")
        at = "" if block is None else self.gguf_block.format(i=block)
        return f"{at}{row.gguf}.{kind}"

    def _names(self, config: Config, fmt: str, block: str) -> dict[str, str]:
        names: dict[str, str] = {}

        def add(rows: tuple[Weight, ...], theirs_at: str, ours_at: str) -> None:
            for row in rows:
                theirs = getattr(row, fmt)
                if theirs is None or not row.when(config):
                    continue
                # a row of each expert's weight: one name per expert (``{e}``)
                each = range(config.n_experts) if "{e}" in row.ours else (None,)
                for e in each:
                    t, o = (theirs, row.ours) if e is None else (
                        theirs.format(e=e), row.ours.format(e=e))  # fmt: skip
                    for kind in ("weight", "bias") if row.bias(config) else ("weight",):
                        names[f"{theirs_at}{t}.{kind}"] = f"{ours_at}{o}.{kind}"

        add(self.model, "", "")
        for i in range(config.n_layers):
            add(self.layer, block.format(i=i), self.ours_block.format(i=i))
        return names


# The two byte-level splits that tokenizers' ByteLevel pre-tokenizer writes itself: GPT-2's
# expression, and every digit split off before it. Any other split is a regular expression.
GPT2_SPLIT, DIGITS_GPT2_SPLIT = "gpt2", "digits+gpt2"


@dataclass(frozen=True)
class PreSplit:
    """How a byte-level BPE vocabulary's text is cut into words before the merges
    (:mod:`dikkat.pretrained.gguf_tokenizer`): llama.cpp's expression for a
    ``tokenizer.ggml.pre`` name (``src/llama-vocab.cpp``), whether a word that is a token
    is taken whole (``ignore_merges``: Llama 3's tokenizer), and whether the text is put in
    Unicode's composed form first (``nfc``: Qwen's ``tokenizer.json`` does; llama.cpp does not,
    so a decomposed accent encodes as the model's own tokenizer encodes it only here)."""

    split: str  # GPT2_SPLIT, DIGITS_GPT2_SPLIT, or a regular expression
    whole_words: bool = False
    nfc: bool = False


@dataclass(frozen=True)
class Family:
    """One architecture, as a family file (``dikkat/pretrained/families/<name>.py``) declares it
    in its module-level ``FAMILY`` (docs/models.md, "Adding a family").

    ``model`` is the dikkat class built from the config (``Decoder`` or ``GPT``);
    ``config_from_gguf(metadata, shapes, values, source)`` and ``config_from_hf(config_json,
    source)`` map a GGUF header (``shapes``: the file's tensors, name → torch shape;
    ``values``: reads one of them, for a tensor that is a setting, RoPE's ``rope_freqs``) or an HF
    ``config.json`` onto its config, refusing by name what dikkat does not implement; None: the
    family is not read from that format. ``gguf_fix`` and ``hf_fix`` put a stored tensor in
    dikkat's layout (called with dikkat's name for it); ``pre_splits`` maps the
    ``tokenizer.ggml.pre`` names of the family's tokenizers to their pre-split."""

    name: str
    model: type[nn.Module]
    tensors: Tensors
    gguf_architecture: str | None = None
    hf_model_types: tuple[str, ...] = ()
    config_from_gguf: FromGGUF | None = None
    config_from_hf: FromHF | None = None
    gguf_fix: FixUp = as_stored
    hf_fix: FixUp = as_stored
    pre_splits: Mapping[str, PreSplit] = field(default_factory=dict)
    # model_types the family recognises and refuses, with the reason (a multimodal variant)
    hf_refused: Mapping[str, str] = field(default_factory=dict)
