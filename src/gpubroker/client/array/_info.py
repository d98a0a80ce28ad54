"""``__array_namespace_info__()``: what this namespace's device offers, told truthfully (no float64 where the
device has no double precision)."""

from __future__ import annotations

from typing import Any

import numpy as np

from gpubroker.client.array._context import Context, Device
from gpubroker.client.array._creation import check_device, default_complex, default_float, supports
from gpubroker.client.array._dtypes import ALL_DTYPES, isdtype

__all__ = ["__array_namespace_info__"]

# The most dimensions an array may have: what every kernel (generated elementwise and reductions, the gather)
# handles.
MAX_DIMENSIONS = 8


class Info:
    """The inspection object of one namespace (the standard's ``__array_namespace_info__()`` result)."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx

    def capabilities(self) -> dict[str, Any]:
        return {"boolean indexing": True, "data-dependent shapes": True, "max dimensions": MAX_DIMENSIONS}

    def default_device(self) -> Device:
        return self._ctx.device

    def devices(self) -> list[Device]:
        return [self._ctx.device]

    def default_dtypes(self, *, device: Device | None = None) -> dict[str, np.dtype[Any]]:
        check_device(self._ctx, device)
        return {"real floating": default_float(self._ctx), "complex floating": default_complex(self._ctx),
                "integral": np.dtype("int64"), "indexing": np.dtype("int64")}

    def dtypes(self, *, device: Device | None = None,
               kind: str | tuple[str, ...] | None = None) -> dict[str, np.dtype[Any]]:
        """The dtypes the device computes in, by name; ``kind`` (a kind name or a tuple of them) narrows them."""
        check_device(self._ctx, device)
        return {dt.name: dt for dt in ALL_DTYPES
                if supports(self._ctx, dt) and (kind is None or isdtype(dt, kind))}


def __array_namespace_info__(ctx: Context) -> Info:
    """The namespace's inspection object."""
    return Info(ctx)
