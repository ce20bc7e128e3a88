"""What every command shares: the Hydra entry and its one-line errors (``cli``), which process this is
(``launcher``), SIGTERM handling (``preemption``), one run per folder (``run_folder``); and the body of
``python infer.py`` (``sample``)."""
