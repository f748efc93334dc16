#!/usr/bin/env bash
# Pipeline schedules side by side with MaxText on 8 virtual CPU devices, interleaved so both see the same
# machine load: the tiny benchmark model cut to 4 layers (width 256, 4 heads of 64, MLP 512, vocab 1024),
# global batch 16 x 128 tokens, stage 2 x fsdp 2 x tensor 2, 4 micro batches.
#
#   MAXTEXT_PYTHON=/path/to/mt-venv/bin/python scripts/pipeline_vs_maxtext.sh [ROUNDS] [jaxtron overrides...]
#
# MaxText (>= 0.2.5, Python >= 3.12; see ../shared/notes/maxtext-baseline.md) runs 40 steps with its defaults
# (bf16 activations, remat_policy=full); the same work for jaxtron is model.dtype=bfloat16 model.remat=full.
# Both figures are medians of per-step times: MaxText's from the seconds it logs for steps 10 to 39, jaxtron's
# from scripts/bench_train.py --sync-each-step (30 timed steps after 3 warmup). jaxtron runs from this checkout
# under $PYTHON (default: python); PYTHON=$MAXTEXT_PYTHON runs it on MaxText's JAX, so both use the same XLA.
# Without MAXTEXT_PYTHON only jaxtron runs. SCHEDULES picks a subset (default: "gpipe circular 1f1b"; also
# zb_h1 and zbv, which MaxText does not have).
set -euo pipefail
ROUNDS=${1:-3}
shift || true
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python}
OUT=$(mktemp -d)
MODEL="model.hidden_size=256 model.num_heads=4 model.num_kv_heads=4 model.head_dim=64 model.intermediate_size=512
       model.vocab_size=1024 model.num_layers=4 data.seq_len=128 train.global_batch_size=16 parallel.stage=2
       parallel.fsdp=2 parallel.tensor=2 parallel.data=1 train.micro_batch_size=2"
MT_PIPE="ici_pipeline_parallelism=2 ici_fsdp_parallelism=2 ici_tensor_parallelism=2 num_pipeline_microbatches=4"

jaxtron() {  # overrides -> s/step
  JAX_PLATFORMS=cpu PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" "$PY" "$HERE/scripts/bench_train.py" \
    --cpu-devices 8 --steps 30 --sync-each-step --json $MODEL "$@" 2> "$OUT/jaxtron.err" \
    | tail -1 | "$PY" -c "import json, sys; print(f\"{json.load(sys.stdin)['step_s_median']:.3f}\")" \
    || { cat "$OUT/jaxtron.err" >&2; return 1; }
}

maxtext() {  # extra MaxText args -> s/step
  local log="$OUT/maxtext_$RANDOM.log"
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 "$MAXTEXT_PYTHON" \
    -m maxtext.trainers.pre_train.train run_name="cpu_$RANDOM" base_output_directory="$OUT/mt" hardware=cpu \
    skip_jax_distributed_system=True dataset_type=synthetic steps=40 enable_checkpointing=false \
    per_device_batch_size=2 max_target_length=128 base_emb_dim=256 base_num_query_heads=4 base_num_kv_heads=4 \
    base_mlp_dim=512 base_num_decoder_layers=4 head_dim=64 vocab_size=1024 attention=dot_product \
    enable_tensorboard=false $MT_PIPE "$@" > "$log" 2>&1
  "$MAXTEXT_PYTHON" - "$log" <<'EOF'
import re, statistics, sys
s = {}
for line in open(sys.argv[1]):
    m = re.search(r"completed step: (\d+), seconds: ([\d.]+),", line)
    if m:
        s[int(m.group(1))] = float(m.group(2))
print(f"{statistics.median(s[i] for i in range(10, 40)):.3f}")
EOF
}

SCHEDULES=${SCHEDULES:-gpipe circular 1f1b}
has() { [[ " $SCHEDULES " == *" $1 "* ]]; }
for r in $(seq "$ROUNDS"); do
  echo "round $r ($(date +%T))"
  if has gpipe; then
    [ -n "${MAXTEXT_PYTHON:-}" ] && echo "  maxtext  gpipe     $(maxtext num_layers_per_pipeline_stage=2 scan_layers=false)"
    echo "  jaxtron  gpipe     $(jaxtron parallel.pipeline_schedule=gpipe "$@")"
  fi
  if has circular; then
    [ -n "${MAXTEXT_PYTHON:-}" ] && echo "  maxtext  circular  $(maxtext num_layers_per_pipeline_stage=1 scan_layers=true)"
    echo "  jaxtron  circular  $(jaxtron parallel.pipeline_schedule=circular parallel.virtual_stages=2 "$@")"
  fi
  if has 1f1b; then
    echo "  jaxtron  1f1b      $(jaxtron parallel.pipeline_schedule=1f1b "$@")"
  fi
  if has zb_h1; then
    echo "  jaxtron  zb_h1     $(jaxtron parallel.pipeline_schedule=zb_h1 "$@")"
  fi
  if has zbv; then
    echo "  jaxtron  zbv       $(jaxtron parallel.pipeline_schedule=zbv "$@")"
  fi
done
rm -rf "$OUT"
