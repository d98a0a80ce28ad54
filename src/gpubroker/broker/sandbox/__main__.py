"""``python -m gpubroker.broker.sandbox --spec JSON -- PROGRAM [ARGS...]``: run PROGRAM in a worker sandbox."""

import sys

from gpubroker.broker.sandbox._launch import main

if __name__ == "__main__":
    sys.exit(main())
