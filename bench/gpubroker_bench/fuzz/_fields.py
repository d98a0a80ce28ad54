"""How a step draws one request's fields, and cheap random payloads."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

__all__ = ["Fields", "payload"]

Draw = Callable[..., Any]


def payload(draw: Draw, n: int) -> bytes:
    """``n`` bytes, cheaply: hypothesis draws a seed rather than every byte."""
    return random.Random(draw(st.integers(0, 2**32))).randbytes(max(n, 0))


class Fields:
    """How one request's fields are drawn: all sane, all wild, or sane but for one (fault injection).

    Sane values are valid as far as the model can tell, so requests reach the device and move real bytes; one
    wild field tests that field's checks in a request otherwise valid.
    """

    def __init__(self, draw: Draw, names: list[str]) -> None:
        self.draw = draw
        mode = draw(st.sampled_from(["sane", "sane", "one_fault", "one_fault", "one_fault", "wild"]))
        self.fault = draw(st.sampled_from(names)) if mode == "one_fault" else None
        self.wild = mode == "wild"

    def sane(self, name: str) -> bool:
        return not self.wild and name != self.fault

    def __call__(self, name: str, sane: st.SearchStrategy[Any], wild: st.SearchStrategy[Any]) -> Any:
        return self.draw(sane if self.sane(name) else wild)
