"""``python -m cutlass_byoc ...``: the ``cutlass-byoc`` command, from an installed package or the source tree."""

import sys

from .cli import main

sys.exit(main())
