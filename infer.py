"""``python infer.py [overrides]``: sample a checkpoint, an export or a pipeline folder (``ringdit.commands.sample``;
``python infer.py --help``)."""

from ringdit.commands.sample import main, prepare  # noqa: F401 - prepare: a run built without sampling it (tests, tools)

if __name__ == "__main__":
    main()
