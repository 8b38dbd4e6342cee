#!/usr/bin/env bash
# One device call: environment facts, a quick compiled correctness smoke test, the tile sweep.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee $OUT/env.txt
python3 -c "import jax, flax; print(jax.__version__, flax.__version__, jax.devices())" | tee -a $OUT/env.txt
timeout ${SWEEP_TIMEOUT:-500} python3 benchmarks/sweep.py --out $OUT/sweep.jsonl --head-dims ${HEAD_DIMS:-64 128} --seq ${SEQ:-4096} 2>&1 | tee $OUT/sweep.log | grep -v "^H="
tail -n 30 $OUT/sweep.log
