"""Pixels and prompts around the model: VAEs, text encoders, preparing datasets, writing pictures and videos.

Used by ``python -m ringdit.prepare`` and ``infer.py``; the model code never imports it (it sees latents and text
embeddings only). Needs diffusers, transformers, imageio (+ imageio-ffmpeg / av) and tqdm.

    vae.py            VAE: a local diffusers VAE, encode / decode with the latent normalisation, tiling
    text.py           TextEncoder: a local T5 / UMT5 / CLIP text model, prompts -> (text, text_mask[, pooled])
    glyph.py          GlyphEncoder: HunyuanVideo 1.5's ByT5, a prompt's quoted text -> (glyph_text, glyph_text_mask)
    folder.py         list_media: a captioned folder -> (path, caption) items
    frames.py         read_image / read_video: one file -> bucket pixels
    windows.py        which frames of a clip: frame_extraction windows, source_fps -> the model's fps
    retext.py         re-captioning: a finished shard's text re-encoded, its latents kept
    compare.py        python -m ringdit.media.compare: two prepared folders' tensors, max / mean |a - b|
    encode_folder.py  encode_folder: a folder -> text_latents shards (ranks, resume, skips); its settings checks
    clip_placement.py  each file probed and placed in its bucket (a clip once per window), cut into shards
    encode_shards.py  encode_folder's work on one rank: files listed and planned, its shards encoded and written
    shard_plan.py     the shards on disk: their paths, out/buckets.json, the checks a resumed run makes
    prepare_ranks.py  a prepare's rank and device, and parallel_vae=true's TileGroup
    encode_report.py  EncodeReport: what a prepare wrote and left out, its summary line
    image_condition.py  encode_image_condition: first frames -> image-to-video conditioning (prepare and infer)
    control.py        encode_control: a control clip -> a control-video model's control latents (infer control=)
    writing.py        write_pixels / write_sample: decoded samples -> PNG grid + PNGs, MP4 (with sound) + GIF
    decode.py         decode_samples; python -m ringdit.media.decode (conf/decode.yaml): samples.npz latents -> media
"""
