"""``python -m lorafusion.cli``: the ``lorafusion`` command."""

import sys

from lorafusion.cli import main

sys.exit(main())
