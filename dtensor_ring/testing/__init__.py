"""Small helpers for tests and examples (not part of the ring-attention API)."""

from .tiny_model import TinyConfig, TinyTransformer, rope_cos_sin

__all__ = ["TinyConfig", "TinyTransformer", "rope_cos_sin"]
