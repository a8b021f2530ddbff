"""Real pretrained models: files on disk and packages on PyPI, loaded into dikkat's own modules."""
