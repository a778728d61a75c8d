"""Symbolic per-operator analysis of the model's layers (no knowledge of GPUs)."""

from mist.analysis.layer import LayerAnalysis, analyze_layer
from mist.analysis.records import B, OpRecord, S

__all__ = ["LayerAnalysis", "analyze_layer", "OpRecord", "B", "S"]
