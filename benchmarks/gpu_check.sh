#!/usr/bin/env bash
# One short GPU check: torch_flash's CUDA kernels against the fp64 reference (incl. the chunk contract ring
# attention relies on), kernel speed per dtype, chunked (ring-like) efficiency, and DiT training-step speed.
#   bash benchmarks/gpu_check.sh 2>&1 | tee gpu_check.log
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
python3 -c "import flash_attn" 2>/dev/null && echo "flash_attn: installed" || echo "flash_attn: not installed"
python3 -m pytest -q -p no:cacheprovider tests/test_backends.py -k cuda -rs 2>&1 | tail -6
for dtype in bfloat16 float32; do
  python3 benchmarks/backends.py --device cuda --dtype $dtype --seq 16384 --heads 16 --head-size 64 --repeat 10
done
python3 benchmarks/chunked_attention.py --device cuda --dtype bfloat16 --seq 32768 --heads 16 --chunks 1 2 4 8 --repeat 5
for backend in torch_flash torch_sdpa; do
  python3 benchmarks/dit_step.py --model DiT-XL/2 --input-size 32 --batch 32 --device cuda --dtype bfloat16 --backend $backend
done
python3 benchmarks/dit_step.py --model DiT-XL/2 --input-size 128 --batch 2 --device cuda --dtype bfloat16 --backend torch_flash
# diffusers' Wan (needs diffusers; carry its wheel where the image lacks it): ringdit vs diffusers' attention in bf16,
# the cuDNN kernel that returns the LSE (chunked backward with the final out/LSE), FSDP2 on CUDA
python3 benchmarks/gpu_diffusers_check.py --layers 4 --frames 21 --height 60 --width 104
