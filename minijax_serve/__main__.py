"""``python -m minijax_serve ...``: the same command as ``minijax-serve``."""

import sys

from minijax_serve.cli import main

if __name__ == "__main__":
    sys.exit(main())
