"""`python -m deploy ...` is `python -m deploy.local ...` (local processes are the default)."""

import sys

from deploy.local import main

sys.exit(main())
