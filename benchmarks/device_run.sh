#!/usr/bin/env bash
# One device call: environment facts, the GPU-marked tests compiled on the GPU, then the benchmark.
# Usage (device tool): bash benchmarks/device_run.sh ; BENCH_ARGS overrides the benchmark's flags.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee $OUT/env.txt
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" | tee -a $OUT/env.txt
if [ "${RUN_TESTS:-1}" = 1 ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -m gpu -p no:cacheprovider tests ${TEST_ARGS:-} 2>&1 | tee $OUT/gpu_tests.log | tail -n 25
fi
if [ "${RUN_BENCH:-1}" = 1 ]; then
  timeout ${BENCH_TIMEOUT:-420} python3 -m pallas_flash.bench --out $OUT/bench.jsonl ${BENCH_ARGS:-} 2>&1 | tee $OUT/bench.log | grep -v "^\[" 
fi
