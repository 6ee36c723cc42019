"""functree.optim."""

__all__: list[str] = []
