"""Mist: automatic memory-parallelism co-optimization for distributed LLM training."""

__version__ = "0.1.0"
