import sys

from gpubroker.broker.worker import run

if __name__ == "__main__":
    run(sys.argv[1:])
