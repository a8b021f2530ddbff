"""Audits of causality and masks for any model (docs/audit.md).

    import dikkat
    report = dikkat.audit.causality(model, vocab_size=256, seq_len=16)
    print(report)              # a short table; report.ok, report.leaks, report.first_leak
    dikkat.audit.mask(lambda ids: model(ids, mask=m), causal() & document(doc), 256, 16)
    dikkat.audit.kv_cache(model)                # cached decoding = a full forward
    dikkat.audit.permutation(block, x)          # blind to position, or not
    dikkat.audit.windows(decoder)               # each layer reads exactly its sliding window

Each probes the model from outside — random tokens, each position set to many token ids in turn
(on a float64 copy of the model), and the gradients through its token embedding, each output
judged against its own dependence on what it may see — so it applies to a dikkat model, a
Hugging Face one or any callable from token ids (B, T) to outputs (B, T, …).
"""

from dikkat.audit.decoding import KVCacheReport, PermutationReport, kv_cache, permutation
from dikkat.audit.dependence import causality, mask
from dikkat.audit.report import Checked, MaskReport, Report, describe
from dikkat.audit.windows import WindowReport, windows

__all__ = [
    "Checked",
    "KVCacheReport",
    "MaskReport",
    "PermutationReport",
    "Report",
    "WindowReport",
    "causality",
    "describe",
    "kv_cache",
    "mask",
    "permutation",
    "windows",
]
