"""A diffusers model's checkpoint written as diffusers folders, one per transformer: ``<out>/transformer/`` (and
``<out>/transformer_2/``, a two-expert model's low-noise expert), each ``config.json`` +
``diffusion_pytorch_model.safetensors`` as ``save_pretrained`` writes them. diffusers loads them
(``WanTransformer3DModel.from_pretrained(out, subfolder="transformer_2")``, or a pipeline folder with them in place),
and ringdit reads them back (``model.pretrained=<out>``, ``init_from=<out>``)."""

from __future__ import annotations

import shutil
from pathlib import Path

from ringdit.atomic import atomic_write
from ringdit.checkpoints.layout import checked_output, first_line, replace_folder, temporary_folder
from ringdit.checkpoints.weights import read_weights
from ringdit.errors import CheckpointError

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"  # diffusers' name for a transformer's unsharded weights


def export_diffusers(ckpt_path: str | Path, out: str | Path, prefer: str = "ema") -> Path:
    """Write the checkpoint's transformer(s) (EMA weights by default) under the folder ``out``, replacing it whole:
    a kill while writing leaves the previous ``out`` as it was."""
    from safetensors.torch import save_file

    from ringdit.spec.model import ModelSpec, is_diffusers_model

    state, info = read_weights(ckpt_path, prefer)
    if not is_diffusers_model(info.get("model") or {}):
        raise CheckpointError(f"{ckpt_path} holds ringdit's DiT, not a diffusers transformer: export it with "
                              f"format=ringdit (a .safetensors file)")
    out = checked_output(out, folder=True, what="format=diffusers (transformer/ ...)")
    _, model = ModelSpec.from_config(info["model"], 1)  # on meta: the architecture configs, no weights
    tmp = Path(temporary_folder(out))
    try:
        for prefix, subfolder in model.subfolders():
            transformer = model.get_submodule(prefix.rstrip("."))
            transformer.save_config(tmp / subfolder)  # config.json with _class_name, as save_pretrained writes it
            tensors = {key[len(prefix):]: value.detach().contiguous().clone()
                       for key, value in state.items() if key.startswith(prefix)}
            with atomic_write(tmp / subfolder / WEIGHTS_NAME) as file:
                save_file(tensors, str(file), metadata={"format": "pt"})
        replace_folder(tmp, out)
    except OSError as error:
        raise CheckpointError(f"cannot write out={out} ({error.strerror or first_line(error)}); choose a writable "
                              f"folder") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # what a failed export had written (gone after a success)
    return out
