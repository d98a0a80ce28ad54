"""``gpubroker.client.array``: the Python Array API standard (2024.12) on a gpubroker device.

``xp = gpubroker.client.array.namespace(gpu)`` for any GpuCompute (a RemoteGpu or an in-process backend); see the
SDK guide's "Arrays" page (docs/sdk/arrays.md). Elementwise functions and reductions run as kernels generated from
one operation table (``_kernels``); matmul, linalg, fft, sorting and set functions run as library operations in
the worker (``GpuCompute.run_library``).
"""

from gpubroker.client.array._array import Array
from gpubroker.client.array._namespace import Namespace, namespace, release_memory

__all__ = ["Array", "Namespace", "namespace", "release_memory"]
