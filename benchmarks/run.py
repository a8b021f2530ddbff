"""`make bench`: run every benchmark in turn; each prints a table and writes results/*.json."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import attention
import checkpoint
import generation
import training

if __name__ == "__main__":
    attention.main([])
    print()
    generation.main([])
    print()
    training.main([])  # add --nanogpt DIR by running benchmarks/training.py yourself
    print()
    checkpoint.main([])
