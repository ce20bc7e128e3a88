"""``python train.py [overrides]``: train or fine-tune (``ringdit.training.run``; ``python train.py --help``)."""

from ringdit.training.run import main, prepare  # noqa: F401 - prepare: a run built without training it (tests, tools)

if __name__ == "__main__":
    main()
