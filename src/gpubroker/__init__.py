"""gpubroker: a GPU API-remoting broker. See gpubroker.client for the SDK."""

__version__ = "0.1.0"
