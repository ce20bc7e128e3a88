#!/usr/bin/env bash
# One-GPU check of the training entry point on CUDA / NCCL: the (dp, ring, ulysses) DeviceMesh built on "cuda" with
# NCCL timeout options, then a short Wan (tiny architecture, head size 64: the CUDA kernels need a multiple of 8) fine-tune through train.py under DDP and under FSDP2 in
# bf16 mixed precision with the torch_flash backend, and sampling from the result. Prints each run's last lines.
#
#   bash benchmarks/gpu_train_check.sh [steps]
set -uo pipefail
cd "$(dirname "$0")/.."
steps=${1:-40}
out=${OUT:-/tmp/gpu_train_check}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

python3 - <<'EOF'
import datetime, os, torch, torch.distributed as dist
from ringdit.parallel import init_sequence_parallel, shard_sequence, gather_sequence
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
dims = init_sequence_parallel(1, 1, timeout=datetime.timedelta(seconds=30), device_type=os.environ.get("DEVICE", "cuda"))
x = torch.randn(2, 10, 4, device="cuda" if torch.cuda.is_available() else "cpu")
y = gather_sequence(shard_sequence(x, dim=1, dims=dims), dim=1, length=10, dims=dims)
print(f"mesh on {dims.mesh.device_type}: shape {tuple(dims.mesh.shape)} dims {dims.mesh.mesh_dim_names}; "
      f"shard/gather round trip exact: {torch.equal(x, y)}")
dist.destroy_process_group()
EOF

for strategy in ddp fsdp; do
  start=$(date +%s)
  python3 train.py experiment=wan_tiny trainer=${TRAINER:-gpu} trainer/strategy=$strategy trainer.max_steps=$steps \
    trainer.precision=${PRECISION:-bf16-mixed} attention_backend=torch_flash model.config.attention_head_dim=64 logger=csv callbacks.sample_grid.every_n_steps=$steps \
    hydra.run.dir=$out/$strategy 2>&1 | grep -v Warning | tail -6
  echo "== $strategy: exit ${PIPESTATUS[0]}, $(( $(date +%s) - start )) s wall for $steps steps (with start-up)"
  tail -n 2 $out/$strategy/csv/metrics.csv
done
python3 infer.py ckpt_path=$out/fsdp/checkpoints/last.ckpt num_samples=4 diffusion.sampling.steps=10 trainer=${TRAINER:-gpu} \
  hydra.run.dir=$out/infer 2>&1 | tail -3
ls $out/infer
