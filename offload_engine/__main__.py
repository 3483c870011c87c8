"""`python -m offload_engine`: the same as the `offload-engine` console script (cli.main)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
