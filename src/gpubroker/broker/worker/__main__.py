import faulthandler
import os
import sys

from gpubroker.broker.sandbox import (
    EXEC_ENV,
    EXIT_SETUP_FAILED,
    SEAL_ENV,
    confine_exec,
    linker_files,
    seal_after_device_open,
    set_dumpable,
)
from gpubroker.broker.worker._process import main

if __name__ == "__main__":
    # exec made the worker dumpable again: no same-uid process may ptrace it or read its memory.
    set_dumpable(False)
    rule = os.environ.pop(EXEC_ENV, None)
    if rule is not None:
        # Sandboxed, where Landlock works: before anything of a tenant's runs, this process and every one it starts
        # may execute only PoCL's linker ("linker", OpenCL), or nothing at all. Never started without it.
        try:
            confine_exec(linker_files() if rule == "linker" else [])
        except OSError as exc:
            print(f"gpubroker sandbox: cannot build the worker's sandbox: Landlock: {exc}", file=sys.stderr,
                  flush=True)
            os._exit(EXIT_SETUP_FAILED)
    # A native crash in a device runtime still leaves a Python stack in the broker's log.
    faulthandler.enable()
    # Sandboxed: once the device is open (CUDA's initialization makes a Unix socket), no new socket of any family.
    code = main(on_device_open=seal_after_device_open if os.environ.pop(SEAL_ENV, None) == "1" else None)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: device runtimes can crash or hang in atexit handlers.
    os._exit(code)
