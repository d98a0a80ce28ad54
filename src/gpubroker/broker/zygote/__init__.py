"""The workers' zygote: one process per broker that has loaded a worker's code once and forks each sandboxed
worker's launcher (``python -m`` this package; the front's side is ``front/workers/_zygote.py``, the messages
``wire/zygote.py``)."""
