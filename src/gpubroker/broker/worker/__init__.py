"""The worker process: one per tenant and device, sandboxed, owning one device context (``python -m`` this package)."""
