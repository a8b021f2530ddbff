"""Run llama.cpp's own ``convert_hf_to_gguf.py`` on Hugging Face folders, all in one process:

    python llamacpp_convert.py CONVERTER OUTTYPE FOLDER...

writes ``FOLDER/llamacpp.gguf`` for each folder. ``CONVERTER`` is a folder holding the script
with the ``conversion`` and ``gguf-py`` folders beside it, as llama.cpp's source tree has them
(the Makefile takes them from the llama-cpp-python sdist).

One thing is given to the converter rather than found: the name of a BPE vocabulary's
pre-tokenizer. llama.cpp finds it by hashing what the tokenizer makes of a test text
(``get_vocab_base_pre`` in its ``conversion/base.py``), and only published vocabularies have a
known hash. The tiny folders' vocabulary splits text by GPT-2's expression (``tiny_hf.py``), so it
is named ``gpt-2``, which is what that expression is called in a GGUF file."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    converter, outtype, *folders = argv
    script = Path(converter) / "convert_hf_to_gguf.py"
    sys.path[:0] = [str(Path(converter)), str(Path(converter) / "gguf-py")]
    from conversion import base  # llama.cpp's, from the path just set

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    for folder in folders:
        out = Path(folder) / "llamacpp.gguf"
        sys.argv = [str(script), folder, "--outtype", outtype, "--outfile", str(out)]
        runpy.run_path(str(script), run_name="__main__")
        if not out.is_file():
            raise SystemExit(f"the converter wrote no {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
