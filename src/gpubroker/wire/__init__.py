"""What every process of gpubroker shares: commands, frames, errors, types, the library op table, the worker protocol.

Imports nothing else of gpubroker: the client, the front and the worker all build on it.
"""
