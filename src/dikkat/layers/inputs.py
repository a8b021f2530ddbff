"""Checks of what enters a layer or a model: token ids, images, and tensors meeting weights.

Each error names the argument and what was wrong with it (the dtype, the shape, the offending
value and where it sits), where PyTorch would say ``index out of range in self`` or ``expected
m1 and m2 to have the same dtype`` from deep inside the first layer that trips over it.

Notation: ``B`` batch, ``T`` tokens, ``V`` vocabulary, ``Ch`` channels.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dikkat.core.tracing import check_traced, tracing
from dikkat.validate import check_int

# nn.Embedding and gather index with these; other integer dtypes must be converted first
ID_DTYPES = (torch.int64, torch.int32)


def check_token_ids(
    name: str,
    ids: object,
    vocab_size: int | None,
    *,
    layout: tuple[str, ...] | None = ("B", "T"),
    ignore_index: int | None = None,
    device: torch.device | None = None,
) -> None:
    """``ids`` is an int64/int32 tensor of ids in [0, ``vocab_size``) (None: any id ≥ 0).

    Args:
        layout: the names of the expected dims, e.g. ``("B", "T")``; None accepts any shape.
        ignore_index: a value also allowed anywhere (a loss target with no loss, e.g. −100).
        device: where the embedding that reads them lives (checked before any id is read).
    """
    want = "an integer tensor" + ("" if layout is None else f" ({', '.join(layout)})")
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name} must be {want}, got {type(ids).__name__}")
    if ids.dtype not in ID_DTYPES:
        raise TypeError(f"{name} must be {want} of int64 or int32, got dtype {ids.dtype}")
    if layout is not None and ids.dim() != len(layout):
        raise ValueError(f"{name} must be {want}, got shape {tuple(ids.shape)}")
    if device is not None and ids.device != device:
        raise ValueError(
            f"{name} is on {ids.device}, but the model's weights are on {device}: move one of "
            f"them (e.g. {name}.to('{device}'))"
        )
    if vocab_size is None or ids.numel() == 0:
        return
    checked = ids if ignore_index is None else ids.masked_fill(ids == ignore_index, 0)
    if tracing():  # torch.compile, export, vmap: the values cannot reach Python here
        ok = ((checked >= 0) & (checked < vocab_size)).all()
        also = f" (or {ignore_index}: no loss)" if ignore_index is not None else ""
        check_traced(ok, f"{name} holds ids outside the vocabulary of {vocab_size}{also}")
        return
    low, high = torch.stack(torch.aminmax(checked)).tolist()  # one sync, not one per bound
    if low < 0 or high >= vocab_size:
        at = ((checked < 0) | (checked >= vocab_size)).nonzero()[0]
        index = tuple(at.tolist())
        also = f" (or {ignore_index}: no loss)" if ignore_index is not None else ""
        raise ValueError(
            f"{name} holds {int(ids[index])} at {index}, outside the vocabulary of {vocab_size}"
            f"{also}"
        )


def check_token_id(name: str, value: object, vocab_size: int, *, optional: bool = False) -> None:
    """One token id (``eos_id``, ``pad_id``, …) inside the vocabulary."""
    check_int(name, value, at_least=0, optional=optional)
    if value is not None and value >= vocab_size:  # type: ignore[operator]
        raise ValueError(f"{name}={value} is outside the vocabulary of {vocab_size}")


def check_valid(name: str, valid: object, ids: Tensor, ids_name: str = "ids") -> None:
    """``valid`` is a bool tensor of the shape of ``ids`` (True = real token, False = padding)."""
    if not isinstance(valid, Tensor) or valid.dtype != torch.bool:
        got = f"dtype {valid.dtype}" if isinstance(valid, Tensor) else type(valid).__name__
        hint = " (convert a 0/1 attention_mask with .bool())" if isinstance(valid, Tensor) else ""
        raise TypeError(
            f"{name} must be a bool tensor of the shape of {ids_name} (True = real token), "
            f"got {got}{hint}"
        )
    if valid.shape != ids.shape:
        raise ValueError(
            f"{name} {tuple(valid.shape)} must have the shape of {ids_name} {tuple(ids.shape)}"
        )
    if valid.device != ids.device:
        raise ValueError(f"{name} is on {valid.device}, {ids_name} on {ids.device}")


def check_images(images: object, channels: int, size: int) -> None:
    """A float tensor of images (B, ``channels``, ``size``, ``size``)."""
    want = (channels, size, size)
    layout = f"(B, {', '.join(map(str, want))})"
    if not isinstance(images, Tensor) or not images.dtype.is_floating_point:
        got = type(images).__name__ + (f" {images.dtype}" if isinstance(images, Tensor) else "")
        raise TypeError(f"images must be a float tensor {layout}, got {got}")
    shape = tuple(images.shape)
    if images.dim() == 4 and shape[1] != channels:
        raise ValueError(
            f"images have {shape[1]} channels, the model {channels}: got {shape}, expected {layout}"
        )
    if shape[1:] != want or images.dim() != 4:
        raise ValueError(f"images must have shape {layout}, got {shape}")


def check_meets(name: str, x: Tensor, weight: Tensor, layer: str, *, mixed: bool = False) -> None:
    """``x`` can meet ``weight``: the same dtype and the same device.

    Under ``torch.autocast`` the dtypes legitimately differ (the ops cast), so only the device
    is checked there. ``mixed``: the op also takes a bf16/fp16 ``x`` with fp32 weights (as
    ``F.layer_norm`` does). The dtype comparison comes first: the common case costs one ``==``.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"{layer} takes {name} as a tensor, got {type(x).__name__}")
    if x.dtype != weight.dtype and not _mixed_ok(x, weight, mixed):
        raise TypeError(
            f"{layer} got {name} of dtype {x.dtype}, but its weights are {weight.dtype}: convert "
            f"one of them (e.g. {name}.to({weight.dtype}) or layer.to({x.dtype}))"
        )
    if x.device != weight.device:
        raise ValueError(
            f"{layer} got {name} on {x.device}, but its weights are on {weight.device}: move one "
            f"of them (e.g. {name}.to('{weight.device}'))"
        )


def _mixed_ok(x: Tensor, weight: Tensor, mixed: bool) -> bool:
    kind = x.device.type  # asking about a device autocast does not know (meta) raises
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return True
    low_precision = x.dtype in (torch.bfloat16, torch.float16)
    return mixed and low_precision and weight.dtype == torch.float32


def check_device(name: str, device: object) -> torch.device:
    """``device`` as a ``torch.device`` that can run a model here: a name torch knows ("cpu",
    "cuda", "cuda:1") or a device, and CUDA only where CUDA is available."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            f"{name} must be a device name or torch.device, got {type(device).__name__}"
        )
    try:
        d = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"{name} {str(device)!r} is not a device torch knows: {e}") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name} {d}: CUDA is not available (torch {torch.__version__})")
    return d
