"""``gpubroker.client.array``: the Python Array API standard (2024.12) on a gpubroker device.

``xp = gpubroker.client.array.namespace(gpu)`` for any GpuCompute (a RemoteGpu or an in-process backend); see the
SDK guide's "Arrays" page (docs/sdk/arrays.md). ``_standard`` lists what the namespace holds. Elementwise functions
and reductions run as kernels generated from operations declared as data (``_op_table``, ``_reductions``) and the
C of ``csrc/``; matmul, linalg, fft, sorting and set functions run as library operations in the worker
(``GpuCompute.run_library``).

The modules import one another in one order, lowest first: ``_dtypes``, ``_views``, ``_memory``; the kernels
(``_csource``, ``_op_table``, ``_reductions``, ``_kernel_source``, ``_kernels``); ``_context``, ``_gather``;
``_array``; the functions (``_elementwise``, ``_creation``, ``_library_calls``, ``_statistical``, ``_indexing``,
``_manipulation``, then the rest); ``_standard`` and ``_namespace`` last, which installs the array's operators.
"""

from gpubroker.client.array._array import Array
from gpubroker.client.array._namespace import Namespace, namespace, release_memory

__all__ = ["Array", "Namespace", "namespace", "release_memory"]
