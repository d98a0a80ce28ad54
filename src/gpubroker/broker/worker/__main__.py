import faulthandler
import os
import sys

from gpubroker.broker.sandbox import set_dumpable
from gpubroker.broker.worker._process import main

if __name__ == "__main__":
    # exec made the worker dumpable again: no same-uid process may ptrace it or read its memory.
    set_dumpable(False)
    # A native crash in a device runtime still leaves a Python stack in the broker's log.
    faulthandler.enable()
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: device runtimes can crash or hang in atexit handlers.
    os._exit(code)
