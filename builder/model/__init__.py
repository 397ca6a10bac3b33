"""The export model: our own PyTorch DeepSeek-V4 + MTP (v4.py), its rope, and eager cache state."""
from .state import ModelState
from .v4 import ForwardOutput, LayerCache, LayerDelta, Transformer

__all__ = ["ForwardOutput", "LayerCache", "LayerDelta", "ModelState", "Transformer"]
