"""functree.train."""

__all__: list[str] = []
