"""Layers: every layer is a :class:`functree.Module`."""

from functree.nn._linear import Dense, identity

__all__ = ["Dense", "identity"]
