"""What every command shares: the wrapper each of the eight runs in (``task``), the Hydra entry and its one-line
errors (``cli``), which process this is (``launcher``), SIGTERM (``sigterm``, without torch; ``preemption``, the
ranks' step boundary), one run per folder (``run_folder``); and the body of ``python infer.py`` (``sample``)."""
