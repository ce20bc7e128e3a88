"""Checkpoints and weight files, read as data and never as code, one job per module:

- ``layout``: where a checkpoint is and whether it is whole (a file, or a sharded folder with every shard its index
  lists); sharded folders replaced by renames, and put back when a kill fell between them.
- ``safe_dcp``: ``torch.distributed.checkpoint`` folders unpickled with allow-lists only.
- ``loading``: a ``torch.save`` file (``weights_only``), or a sharded folder assembled on one process.
- ``optimizer_state``: optimizer state numbered (torch) or named (DCP), converted either way.
- ``weights``: a model's state dict (EMA or raw) and its configs, from any supported format.
- ``fit``: loading weights into a model: strict key and shape checks, label tables of another class count.
- ``safetensors_export``: a checkpoint's weights and configs written as one ``.safetensors`` file.

Atomic writing of single files lives in ``ringdit.common.atomic``.
"""
