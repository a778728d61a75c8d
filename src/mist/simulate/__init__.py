"""Cost model: per-layer costs under a strategy and their composition (no GPU needed)."""
