"""speedmatrix: speed test matrices for vLLM servers."""

__version__ = "0.1.0"
