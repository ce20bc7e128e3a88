"""Local Hugging Face folders as ringdit reads them: a pipeline's part found in its subfolder or given directly,
folders that name their own code refused, and the transformers classes text encoders load as (every load passes
``REMOTE_CODE``: never a folder's own code, never a prompt to run it)."""

from __future__ import annotations

from pathlib import Path

from ringdit.common.errors import ConfigError
from ringdit.common.safe_json import read_json

# config.json "model_type" -> the encoder-only class (a full T5 checkpoint also loads into its encoder)
ENCODERS = {"t5": "T5EncoderModel", "umt5": "UMT5EncoderModel", "clip_text_model": "CLIPTextModel",
            "clip": "CLIPTextModel", "clip_text_with_projection": "CLIPTextModel",
            "qwen2_5_vl_text": "Qwen2_5_VLTextModel",  # HunyuanVideo 1.5's, with prompt_template=hunyuan_video15
            "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",  # Qwen-Image's, with prompt_template=qwenimage
            "qwen3_vl": "Qwen3VLForConditionalGeneration",  # MiniMax-H3's, with prompt_template=minimax_h3
            "mistral3": "Mistral3ForConditionalGeneration",  # Flux.2's, with prompt_template=flux2
            "gemma3": "Gemma3ForConditionalGeneration"}  # LTX-2's, with prompt_template=ltx2 (its connectors)


def find_folder(path, subfolder: str, marker: str, setting: str) -> Path:
    """``path/subfolder`` when it holds ``marker`` (a pipeline repo), else ``path`` when it does."""
    root = Path(str(path)).expanduser()
    if not root.exists():
        raise ConfigError(f"{setting}={path} does not exist; pass a local transformers folder (save_pretrained's)")
    for folder in (root / subfolder, root):
        if (folder / marker).is_file():
            refuse_remote_code(folder, marker, setting, path)
            return folder
    raise ConfigError(f"{setting}={path} has no {marker} (looked in {root / subfolder} and {root}); pass the folder "
                      f"save_pretrained wrote")


def refuse_remote_code(folder: Path, marker: str, setting: str, path) -> None:
    """A folder whose configs name their own Python classes (``auto_map``: transformers would import the folder's
    code, and on a terminal offer to run it) is refused: ringdit loads only the classes transformers ships, with
    ``trust_remote_code=False`` (see ``REMOTE_CODE``) so that nothing is ever offered."""
    for name in dict.fromkeys((marker, "config.json")):
        if not (folder / name).is_file():
            continue
        config = read_json(folder / name, f"{setting}={path}: {folder / name}", kind=dict,
                           fix="pass the folder save_pretrained wrote")
        if "auto_map" in config:
            raise ConfigError(f"{setting}={path}: {folder / name} names custom code (auto_map: "
                              f"{', '.join(sorted(map(str, config['auto_map'])))[:80]}), which ringdit never runs; "
                              f"pass a folder of a model transformers itself implements (T5, UMT5, CLIP, Qwen2.5-VL, "
                              f"Mistral3, ...)")


REMOTE_CODE = {"trust_remote_code": False}  # every transformers load: never the folder's code, never a prompt
