"""``python -m ringdit.caching calibrate CKPT``: see ``ringdit.caching.calibrate``."""

from ringdit.caching.calibrate import main

main()
