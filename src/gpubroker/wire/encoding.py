"""The one encoding of every message between gpubroker's processes: msgpack through one msgspec encoder.

Its own module, importing nothing but msgspec, so that a process that needs only to encode (the front's acceptor
process, which must start quickly and import no numpy) shares it with every other."""

from __future__ import annotations

from typing import Final

import msgspec

__all__ = ["encode"]

_encoder: Final = msgspec.msgpack.Encoder()
encode: Final = _encoder.encode  # Batch, Ack, or any message of gpubroker/wire -> bytes
