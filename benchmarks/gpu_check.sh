#!/usr/bin/env bash
# One-command GPU check (issue 13), under 8 minutes on one H100/H200:
#   bf16-vs-fp32 logits of every scheme; bf16 tokens/s + MFU + peak memory of pre_ln and keel at
#   width 1024 x 64 and x 512 sub-layers and of the bench (peri_ln, hyper_connections, mhc,
#   attn_res) at 64, eager and torch.compile; peak memory at 1024 sub-layers with activation
#   checkpointing; 20 training steps of the paper-64 preset (offline corpus); zero graph breaks and
#   no recompile-limit hit at 64 sub-layers (every scheme, AC on/off); 2-process NCCL FSDP2 + DCP
#   save/resume (2 GPUs); every scheme exported to Hugging Face generating a left-padded batch
#   on the device as one prompt at a time; pre_ln and keel tokens/s against transformers' Llama;
#   fp16-autocast (V100/T4 precision): every scheme's logits and loss-scaled gradient norm against
#   fp32, and a paper-64 fp16 run checkpointed, resumed, its losses and loss scales repeated.
#   Each row ends with pass / FAIL / skip; the exit status is 1 when a row failed.
# Usage:   benchmarks/gpu_check.sh OUT.md              (the table is printed and written to OUT.md)
#          benchmarks/gpu_check.sh OUT.md --dry-run    (tiny shapes on the CPU: every code path)
# PYTHON selects the interpreter (default: python); see benchmarks/gpu_check.py for details.
set -euo pipefail
if [ "$#" -lt 1 ] || [ "${1#-}" != "$1" ]; then
    echo "usage: $0 OUT_FILE [--dry-run] [--sections bf16,compile,speed,memory,levers,train,fsdp,hf,fp16]" >&2
    exit 2
fi
out=$1
shift
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export PYTHONPATH="$(dirname "$here")${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" "$here/gpu_check.py" --out "$out" "$@"
