"""User-facing descriptions of what to train and where: models, clusters, training setup."""

from mist.specs.model import ModelSpec
from mist.specs.training import ClusterSpec, TrainingSpec

__all__ = ["ModelSpec", "ClusterSpec", "TrainingSpec"]
