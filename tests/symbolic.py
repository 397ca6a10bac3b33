"""A stand-in for TensorRT's symbolic shape dims in tests of launch plans: it has +, * and // only, the operations
plans may use (launch.py), so a plan doing more with a dim (int(), min, a comparison) fails; .text shows the
expression built.
"""
from __future__ import annotations


class SymbolicDim:
    def __init__(self, text: str):
        self.text = text

    def _op(self, sign: str, a: object, b: object) -> SymbolicDim:
        return SymbolicDim(f"({getattr(a, 'text', a)} {sign} {getattr(b, 'text', b)})")

    def __add__(self, other): return self._op("+", self, other)
    def __radd__(self, other): return self._op("+", other, self)
    def __mul__(self, other): return self._op("*", self, other)
    def __rmul__(self, other): return self._op("*", other, self)
    def __floordiv__(self, other): return self._op("//", self, other)
