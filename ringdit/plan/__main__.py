"""``python -m ringdit.plan``."""

import sys

from ringdit.plan import main

sys.exit(main())
