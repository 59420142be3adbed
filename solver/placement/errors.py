"""The placement solver's one error type, in its own module so every part can raise it without import cycles."""


class PlacementError(ValueError):
    """An input to the placement solver is malformed or the instance is infeasible."""
