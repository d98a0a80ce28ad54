"""The device calls of the array namespace, recorded without a device (``kernel_trace``), are the ones checked in:
every generated kernel source, launch, upload and library call of a broad set of operations, dtypes, layouts and
reductions on a CUDA device and three OpenCL ones. A refactor of ``client/array`` keeps them; a change meant to
alter them records them anew (``python -m tests.client.array.kernel_trace --write``) and says why in its commit."""

from __future__ import annotations

import json

from tests.client.array import kernel_trace


def test_every_case_traces_as_checked_in() -> None:
    expected = json.loads(kernel_trace.DIGESTS.read_text())
    found = kernel_trace.digests()
    changed = sorted(k for k in expected.keys() | found.keys() if expected.get(k) != found.get(k))
    assert not changed, (f"these cases' device calls changed: {changed}; compare the traces of both versions "
                         "(python -m tests.client.array.kernel_trace --dump DIR)")
