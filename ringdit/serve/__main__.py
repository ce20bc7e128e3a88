"""``python -m ringdit.serve ckpt_path=...``: see ``ringdit.serve``."""

from ringdit.serve import main

main()
