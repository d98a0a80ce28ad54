import sys

from gpubroker.broker.zygote._serve import main

if __name__ == "__main__":
    sys.exit(main())
