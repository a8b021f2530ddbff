"""Built-in corpora and training windows."""

import pytest
import torch

from dikkat.tasks import step_generator
from dikkat.tasks.corpus import (
    encode_corpus,
    load_corpus,
    random_windows,
    stdlib_files,
    text_files,
)
from dikkat.text import ByteTokenizer


def test_stdlib_corpus_is_split_by_file_with_a_fixed_seed():
    files = stdlib_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    a = load_corpus(max_bytes=300_000, seed=0)
    b = load_corpus(max_bytes=300_000, seed=0)
    c = load_corpus(max_bytes=300_000, seed=1)
    assert (a.train, a.val) == (b.train, b.val)  # same seed, same split
    assert a.val != c.val  # another seed, other validation files
    assert a.n_train_files + a.n_val_files == len(files)
    assert len(a.train) >= 300_000 and len(a.val) > 0


def test_validation_files_never_reach_training(tmp_path):
    for i in range(20):
        (tmp_path / f"f{i}.py").write_text(f"# file {i}\n" + f"x{i} = {i}\n" * 50)
    corpus = load_corpus(tmp_path, val_fraction=0.2, seed=3)
    val_ids = {line.split()[-1] for line in corpus.val.splitlines() if line.startswith("# file")}
    train_ids = {
        line.split()[-1] for line in corpus.train.splitlines() if line.startswith("# file")
    }
    assert len(val_ids) == 4 and len(train_ids) == 16
    assert not val_ids & train_ids


def test_a_single_file_is_split_by_position(tmp_path):
    f = tmp_path / "book.txt"
    f.write_text("".join(chr(97 + i % 26) for i in range(1000)))
    corpus = load_corpus(f, val_fraction=0.1)
    assert corpus.train + corpus.val == f.read_text()
    assert len(corpus.val) == 100


@pytest.mark.parametrize("bad", ["/no/such/path", None])
def test_bad_data_paths(tmp_path, bad):
    if bad is None:  # a folder without text files
        (tmp_path / "x.bin").write_bytes(b"\0")
        with pytest.raises(ValueError, match="no text files"):
            text_files(tmp_path)
    else:
        with pytest.raises(FileNotFoundError, match="does not exist"):
            load_corpus(bad)


def test_windows_are_next_token_pairs_and_deterministic_per_step():
    ids = encode_corpus("abcdefghijklmnopqrstuvwxyz" * 10, ByteTokenizer())
    assert ids.dtype == torch.uint8
    x, y = random_windows(ids, 8, 16, step_generator(0, 5))
    assert x.shape == y.shape == (8, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
    assert torch.equal(((x - 97 + 1) % 26) + 97, y)  # each target is the next letter
    x2, _ = random_windows(ids, 8, 16, step_generator(0, 5))
    x3, _ = random_windows(ids, 8, 16, step_generator(0, 6))
    assert torch.equal(x, x2) and not torch.equal(x, x3)
    with pytest.raises(ValueError, match="fewer than a window"):
        random_windows(ids[:10], 2, 16, step_generator(0, 0))
