"""`Term`: one named number of an estimate, with the formula it comes from."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Term:
    """One named number of an estimate: `value` in seconds, bytes or FLOPs, and how it arises.

    `total`: for a communication term, the whole collective time, of which
    `value` is the exposed part (None for the others).
    """

    name: str
    value: float
    formula: str
    total: float | None = None
