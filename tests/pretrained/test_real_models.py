"""SmolLM2-135M-Instruct and Gemma 3 270M, loaded natively from their GGUF files, against
transformers reading the same files.

What is compared, and why (docs/models.md, "How exact"):

- a text shorter than 512 tokens: dikkat's fp32 logits within 1e-3 of transformers' fp32 logits;
- a text of 1 300 tokens (past Gemma 3's 512-key window, so its sliding layers matter): both fp32
  runs against an fp64 reference computed by transformers' own code (:mod:`hf_reference`).
  transformers' fp32 RoPE angles move its logits there by ~4e-3, so the two fp32 runs are
  compared through the reference: dikkat within 1e-3 of it, and no further from it than
  transformers is;
- greedy continuations, token for token, of chat prompts (SmolLM2) and plain text (Gemma 3).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch
from hf_reference import exact_fp64

import dikkat
from dikkat.weights import inference_model

pytest.importorskip("transformers")

LONG = 1300  # tokens: past Gemma 3's window of 512
LAST = 96  # logits compared at the last positions of the long text (the furthest from 0)


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def pair(request):
    """(name, dikkat's Pretrained, transformers' model) for one real GGUF file."""
    path: Path = request.getfixturevalue(f"{request.param}_gguf")
    from transformers import AutoModelForCausalLM

    ours = dikkat.pretrained.load(path, weights="fp32")  # dequantised, as transformers reads it
    theirs = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return request.param, ours, theirs


def stdlib_text(tokenizer, n: int) -> list[int]:
    """The first ``n`` tokens of some of this Python's standard-library sources: code, comments
    and docstrings, read from the installation itself."""
    root = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((root / name).read_text() for name in ("textwrap.py", "colorsys.py"))
    ids = tokenizer.encode(text)
    assert len(ids) >= n
    return ids[:n]


def last_logits(model_forward_hidden, head, ids: torch.Tensor, k: int) -> torch.Tensor:
    with torch.no_grad():
        return head(model_forward_hidden(ids)[:, -k:]).double()


def test_a_short_text_gives_transformers_logits(pair):
    _, ours, theirs = pair
    ids = torch.tensor([stdlib_text(ours.tokenizer, 300)])
    with torch.no_grad():
        got, want = ours.model(ids), theirs(ids).logits
    assert want.abs().max() > 10  # real logits, not a comparison of zeros
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_long_text_is_as_exact_as_fp64_allows(pair):
    name, ours, theirs = pair
    ids = torch.tensor([stdlib_text(ours.tokenizer, LONG)])
    if name == "gemma3":  # the window is really used: 5 of 6 layers see 512 keys of 1 300
        assert ours.model.config.sliding_window == 512 < LONG
    reference = exact_fp64(theirs)
    ref = last_logits(lambda x: reference.model(x).last_hidden_state, reference.lm_head, ids, LAST)
    got = last_logits(lambda x: ours.model(x, return_hidden=True), ours.model.lm_head, ids, LAST)
    hf = last_logits(lambda x: theirs.model(x).last_hidden_state, theirs.lm_head, ids, LAST)
    ours_error = (got - ref).abs().max().item()
    theirs_error = (hf - ref).abs().max().item()
    assert ours_error <= 1e-3, f"dikkat fp32 is {ours_error:.2e} from the fp64 reference"
    assert ours_error <= theirs_error, (ours_error, theirs_error)
    # and dikkat in fp64 is the reference's math, to fp64 rounding of fp32-stored parameters
    ours64 = dikkat.pretrained.load(ours.path, dtype=torch.float64, weights="fp32")
    got64 = last_logits(
        lambda x: ours64.model(x, return_hidden=True), ours64.model.lm_head, ids, LAST
    )
    assert (got64 - ref).abs().max().item() <= 1e-4


def test_greedy_continuations_equal_transformers(pair):
    name, ours, theirs = pair
    if name == "smollm2":
        questions = ("What is the capital of France?", "Write a haiku about the sea.",
                     "List three prime numbers.")  # fmt: skip
        prompts = [
            ours.tokenizer.encode(ours.chat_prompt([{"role": "user", "content": q}]),
                                  add_special=False)
            for q in questions
        ]  # fmt: skip
    else:
        texts = ("The capital of France is", "def fibonacci(n):", "Bugün hava çok güzel ve")
        prompts = [ours.tokenizer.encode(t) for t in texts]
    eos = theirs.generation_config.eos_token_id
    for prompt in prompts:
        with torch.no_grad():  # transformers stops after its EOS: so does the comparison
            want = theirs.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
        got = ours.model.generate([prompt], 24, eos_id=eos)[0]
        assert got == want[0].tolist(), ours.tokenizer.decode(want[0, len(prompt) :].tolist())


def test_smollm2_answers_the_question(smollm2_gguf):
    lm = dikkat.pretrained.load(smollm2_gguf)
    answer = lm.chat([{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in answer


@pytest.mark.parametrize("weights", ["bf16", "int8", "w8a8", "q8", "q4", "file"])
def test_the_weight_formats_run_and_stay_close(smollm2_gguf, weights):
    """Each format's loss on real text near the dequantised fp32 model's; "file": the file's
    own Q4_1/Q8_0 blocks kept packed (the default), which differ from the dequantised model
    only by the activations' rounding to 8 bits, so they stay within 1 %."""
    from dikkat.weights import w8a8_available

    if weights == "w8a8" and not w8a8_available():
        pytest.skip("w8a8 needs PyTorch's FBGEMM int8 kernels (x86)")
    lm = dikkat.pretrained.load(smollm2_gguf, weights="fp32")
    ids = torch.tensor([stdlib_text(lm.tokenizer, 200)])
    with torch.no_grad():
        fp32 = torch.log_softmax(lm.model(ids)[0, :-1].double(), -1)
        if weights == "file":
            model = dikkat.pretrained.load(smollm2_gguf).model
        else:
            model = inference_model(lm.model, weights)
        low = torch.log_softmax(model(ids)[0, :-1].double(), -1)
    targets = ids[0, 1:, None]
    nll32 = -fp32.gather(-1, targets).mean().item()
    nll = -low.gather(-1, targets).mean().item()
    assert 0.5 < nll32 < 5  # a real model on real text
    bound = 0.01 if weights == "file" else 0.1
    assert abs(nll - nll32) < bound * nll32, (weights, nll, nll32)
