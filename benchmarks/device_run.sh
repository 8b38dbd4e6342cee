#!/usr/bin/env bash
# One device call: environment facts, the GPU-marked tests compiled on the GPU, the benchmark.
# Knobs: RUN_TESTS=0/1, TEST_ARGS, BENCH_ARGS (grid flags), RUN_MASKS=0/1 (masked workloads).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee $OUT/env.txt
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__)" | tee -a $OUT/env.txt
if [ "${RUN_TESTS:-1}" = 1 ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -m gpu -p no:cacheprovider ${TEST_ARGS:-tests} 2>&1 | tee $OUT/gpu_tests.log | tail -n 30
fi
if [ "${RUN_MASKS:-1}" = 1 ]; then
  timeout 150 python3 -m pallas_flash.bench --suite masks --out $OUT/masks.jsonl 2>&1 | tee $OUT/masks.log | tail -n 12
fi
if [ "${RUN_BENCH:-1}" = 1 ]; then
  timeout ${BENCH_TIMEOUT:-300} python3 -m pallas_flash.bench --out $OUT/bench.jsonl ${BENCH_ARGS:-} 2>&1 | tee $OUT/bench.log | grep -v "^\["
fi
