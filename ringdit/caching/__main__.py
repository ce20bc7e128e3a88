"""``python -m ringdit.caching calibrate ckpt_path=CKPT``: see ``ringdit.caching.calibrate``."""

import sys

from ringdit.caching.calibrate import main

sys.exit(main())
