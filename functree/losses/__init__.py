"""functree.losses."""

__all__: list[str] = []
