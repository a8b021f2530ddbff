"""benchmarks/llamacpp.py without llama.cpp: its parsers, tables and llama-perplexity's chunking
on made-up inputs, and the speed rounds end to end with stand-in binaries (nothing is built)."""

import importlib
import json
import math
import os
import stat
import sys
from pathlib import Path

import pytest
import torch

from dikkat.models import Decoder, DecoderConfig

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def lc(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("llamacpp")


@pytest.fixture
def quality(lc):
    return importlib.import_module("llamacpp_quality")


@pytest.fixture
def build(lc):
    return importlib.import_module("llamacpp_build")


def bench_json(prefill_ts: float, decode_ts: float) -> str:
    """What ``llama-bench -p 512 -n 128 -o json`` prints, the fields read kept."""
    return json.dumps(
        [
            {"n_prompt": 512, "n_gen": 0, "avg_ts": prefill_ts, "samples_ts": [prefill_ts]},
            {"n_prompt": 0, "n_gen": 128, "avg_ts": decode_ts, "samples_ts": [decode_ts]},
        ]
    )


def test_llama_bench_json_gives_prefill_and_decode(lc, build):
    assert lc.parse_llama_bench(bench_json(900.5, 80.25), 512, 128) == {
        "prefill_tok_s": 900.5,
        "decode_tok_s": 80.25,
    }
    with pytest.raises(build.LlamaCppError, match="no pp256"):
        lc.parse_llama_bench(bench_json(900.5, 80.25), 256, 128)


def test_dikkat_json_is_found_after_log_lines_or_indented(lc, build):
    one = {"decode_tok_s": [50.0, 52.0], "prefill_tok_s": [700.0, 710.0], "read_gb_s": 9.5}
    assert lc.parse_dikkat_json("loading smollm2\n{not json\n" + json.dumps(one) + "\n") == one
    assert lc.parse_dikkat_json(json.dumps(one, indent=2)) == one
    with pytest.raises(build.LlamaCppError, match="prefill_tok_s"):
        lc.parse_dikkat_json(json.dumps({"decode_tok_s": [1.0]}))
    with pytest.raises(build.LlamaCppError, match="no JSON"):
        lc.parse_dikkat_json("Traceback (most recent call last):\n")


def test_medians_over_rounds_and_the_table_of_ratios(lc):
    runs = {
        "llama.cpp": [{"decode_tok_s": d, "prefill_tok_s": 10 * d} for d in (100.0, 90.0, 120.0)],
        "dikkat": [
            {"decode_tok_s": [d, 1e9, -1e9], "prefill_tok_s": [p]}  # a list: its median
            for d, p in ((40.0, 300.0), (60.0, 200.0), (50.0, 250.0))
        ],
    }
    m = lc.medians(runs)
    assert m == {
        "llama.cpp": {"decode_tok_s": 100.0, "prefill_tok_s": 1000.0},
        "dikkat": {"decode_tok_s": 50.0, "prefill_tok_s": 250.0},
    }
    rows = lc.speed_table({"smollm2": m}).splitlines()
    assert rows[2] == "| smollm2 | llama.cpp | 100.0 | 1000.0 |  |  |"
    assert rows[3] == "| smollm2 | dikkat | 50.0 | 250.0 | 0.50 | 0.25 |"


def test_agreeing_tokens_counts_the_common_start(quality):
    assert quality.agreeing_tokens(["Hel", "lo", " world", "!"], "Hello world?") == 3
    assert quality.agreeing_tokens(["Hel", "lo"], "Help") == 1
    assert quality.agreeing_tokens([], "anything") == 0
    assert quality.agreeing_tokens(["a", "b"], "") == 0


def test_token_pieces_give_each_token_its_new_text(quality):
    words = {1: "Hel", 2: "lo", 3: " w", 4: "orld"}
    assert quality.token_pieces(lambda r: "".join(words[i] for i in r), [1, 2, 3, 4]) == [
        "Hel", "lo", " w", "orld"
    ]  # fmt: skip
    # a character split over two tokens: it comes with the second; a rewrite agrees with nothing
    text = {(5,): "\ufffd", (5, 6): "é", (5, 6, 7): "éa", (5, 6, 7, 8): "ea"}
    pieces = quality.token_pieces(lambda r: text[tuple(r)], [5, 6, 7, 8])
    assert pieces == ["", "é", "a", "\ufffd"]
    assert quality.agreeing_tokens(pieces, "éab") == 3


@pytest.mark.parametrize("bos", [None, 1])
def test_perplexity_chunks_follow_llama_perplexity(quality, bos):
    ids = list(range(100, 100 + 2 * 16 + 7))  # two whole chunks of 16, 7 tokens left over
    chunks = quality.perplexity_chunks(ids, 16, bos)
    assert len(chunks) == 2
    for i, (run_ids, targets) in enumerate(chunks):
        original = ids[16 * i : 16 * (i + 1)]
        assert run_ids == ([bos, *original[1:]] if bos is not None else original)
        assert targets == original[9:]  # predicted from positions 8 … 14
        assert len(targets) == 16 - 16 // 2 - 1
    with pytest.raises(ValueError, match="fewer than 2 × n_ctx = 40"):
        quality.perplexity_chunks(ids, 20, bos)


def test_dikkat_perplexity_scores_the_second_half_of_each_chunk(quality):
    """Against every position's log-softmax in fp64 from the model's full logits."""
    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=50, max_len=32, d_model=16, n_layers=1, n_heads=2)
    model = Decoder(config).double().eval()
    ids = torch.randint(0, 50, (3 * 12 + 5,)).tolist()
    nll, count = 0.0, 0
    for c in range(3):
        chunk = [7, *ids[12 * c + 1 : 12 * (c + 1)]]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([chunk]))[0].double(), -1)
        for j in range(6, 11):  # position j predicts the chunk's token j + 1
            nll -= logp[j, ids[12 * c + j + 1]].item()
            count += 1
    ours = quality.dikkat_perplexity(model, ids, 12, bos=7)
    assert ours == pytest.approx(math.exp(nll / count), rel=1e-12)
    assert abs(ours - quality.dikkat_perplexity(model, ids, 12, bos=None)) > 1e-9  # BOS matters


def test_held_out_text_is_cut_at_a_line_without_a_final_newline(quality, build):
    text = quality.heldout_text(5000)
    assert 4000 < len(text) <= 5000 and not text.endswith("\n")
    with pytest.raises(build.LlamaCppError, match="fewer than"):
        quality.heldout_text(10**9)


def fake_bins(build, cache: Path, version: str, log: Path) -> None:
    """Stand-in binaries in the build folder, stamped as built: each logs its call."""
    bins = cache / f"build-{version}" / "bin"
    bins.mkdir(parents=True)
    for name in build.TARGETS:
        script = bins / name
        script.write_text(f"#!/bin/sh\necho {name} >> {log}\necho '{bench_json(800.0, 80.0)}'\n")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    (bins.parent / "dikkat-stamp").write_text(build.stamp_text(version))


def stand_in_run(lc, build, tmp_path: Path, *extra: str) -> tuple[dict, list[list[str]], Path]:
    """``llamacpp.py`` over an empty model file, 2 rounds, with stand-in binaries and a stand-in
    dikkat that logs its PYTHONPATH and arguments and prints fixed figures: (its results, the
    calls logged, split, the model's path)."""
    log, model, out = tmp_path / "calls.txt", tmp_path / "tiny.gguf", tmp_path / "out"
    model.write_bytes(b"")
    fake_bins(build, tmp_path / "cache", "9.9.9", log)
    dikkat = (
        f"{sys.executable} -c \"import json,os,sys; open('{log}','a').write('dikkat '"
        f"+os.environ.get('PYTHONPATH','-')+' '+' '.join(sys.argv[1:])+'\\n'); "
        f"print(json.dumps({{'decode_tok_s': [40.0], 'prefill_tok_s': [400.0], "
        f"'read_gb_s': 9.0}}))\""
    )
    argv = f"--models {model} --rounds 2 --skip quality --cache {tmp_path / 'cache'} "
    argv += f"--llamacpp-version 9.9.9 --out {out}"
    results = lc.main([*argv.split(), "--dikkat-cmd", dikkat, *extra])
    return results, [c.split() for c in log.read_text().splitlines()], model


def test_speed_rounds_alternate_engines_and_write_the_table(lc, build, tmp_path, capsys):
    results, calls, model = stand_in_run(lc, build, tmp_path)
    assert [c[0] for c in calls] == ["llama-bench", "dikkat", "dikkat", "llama-bench"]
    flags = "--threads 2 --prefill-tokens 512 --new-tokens 128 --prompt-tokens 16 --repeat 1"
    assert calls[1][2:] == [str(model), *flags.split(), "--json"]
    assert results["models"][str(model)]["speed"]["dikkat"]["decode_tok_s"] == 40.0
    out = tmp_path / "out"
    table = (out / "llamacpp.md").read_text()
    assert "| dikkat | 40.0 | 400.0 | 0.50 | 0.50 |" in table
    assert "read bandwidth 9.0 GB/s" in table
    assert json.loads((out / "llamacpp.json").read_text())["report"] == table
    assert table in capsys.readouterr().out


def test_before_runs_another_tree_s_dikkat_in_the_same_rounds(lc, build, tmp_path):
    results, calls, model = stand_in_run(lc, build, tmp_path, "--before", "/old/src")
    ours = os.environ.get("PYTHONPATH", "-")  # this tree's dikkat runs as the tests import it
    paths = [c[1] if c[0] == "dikkat" else c[0] for c in calls]
    assert paths == ["llama-bench", ours, "/old/src", "/old/src", ours, "llama-bench"]
    assert set(results["models"][str(model)]["speed"]) == {"llama.cpp", "dikkat", "dikkat before"}
    table = (tmp_path / "out" / "llamacpp.md").read_text()
    assert "| dikkat before | 40.0 | 400.0 | 0.50 | 0.50 |" in table


def test_a_missing_cmake_is_one_line_and_a_non_zero_exit(lc, build, tmp_path, monkeypatch):
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    argv = ["--quick", "--cache", str(tmp_path), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit, match=r"^llamacpp.py: cmake is not installed[^\n]*$"):
        lc.main(argv)
    assert not any(tmp_path.iterdir())  # nothing downloaded, built or written


def test_quality_table_has_a_row_per_model(quality):
    ppl = {"same_ids": True, "chunks": 10, "llama_ppl": 8.0, "dikkat_ppl": 8.04, "rel_diff": 0.005}
    parted = {"same_prompt_ids": True, "agreeing_tokens": 2, "dikkat_tokens": 64,
              "margin_at_split": 0.27, "llama_took_second": True}  # fmt: skip
    same = {"same_prompt_ids": False, "agreeing_tokens": 64, "dikkat_tokens": 64}
    rows = quality.quality_table(
        {"a": {"greedy": parted, "perplexity": ppl}, "b": {"greedy": same, "perplexity": ppl}}
    ).splitlines()
    assert rows[2] == (
        "| a | True | 2/64 | 0.270 (llama.cpp took dikkat's 2nd) | True | 10 | 8.0000 | 8.0400 "
        "| +0.50 % |"
    )
    assert rows[3].startswith("| b | False | 64/64 |  | True | 10 |")
    assert all(r.count("|") == rows[0].count("|") for r in rows)
