"""ringdit: context-parallel Diffusion Transformers."""

import logging

__version__ = "0.1.0"

# torchao (the 8-bit optimizer's library) is imported by diffusers and transformers whenever it is installed, and
# says at every import that its CUDA extensions do not load here and that a torch.compile registration is
# deprecated: nothing a ringdit user can act on, printed before every command's own output. Errors still show.
for _noisy in ("torchao", "diffusers.quantizers.torchao.torchao_quantizer", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)
