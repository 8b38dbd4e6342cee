#!/usr/bin/env bash
# One device call, made of stages run in the order given (default: tests masks grid):
#   tests  the gpu-marked tests compiled on the GPU, in pytest processes side by side
#   masks  python -m pallas_flash.bench --suite masks
#   grid   python -m pallas_flash.bench (the FA2 grid; BENCH_ARGS adds flags)
#   compile  python -m pallas_flash.bench --suite compile (COMPILE_ARGS adds flags)
#   layers  benchmarks/experiments.py compile-forms: compile time and XLA fusions per backward
#          form and depth (LAYERS_POINTS, e.g. "fixed:1 fixed:24"; default each form at 1 and 24)
#   tiles  benchmarks/experiments.py tiles-masked;  split  benchmarks/experiments.py split-kv
#   mosaic  benchmarks/experiments.py mosaic-tiles (MOSAIC_ARGS, e.g. "--head-dims 64 --seqs 512")
#   mosaicbwd  benchmarks/experiments.py mosaic-backward (MOSAIC_ARGS)
#   mosaicgqa  benchmarks/experiments.py mosaic-gqa (MQA/GQA, the dK/dV kernel's head splits)
#   train  benchmarks/device_train.sh (the end-to-end training table)
#   sweep  the property sweep compiled (tests/test_property.py): SWEEP_PROCS (default: as for
#          TEST_WORKERS=auto) pytest processes
#          side by side, each with fresh seeds on one gpu path of SWEEP_PATHS in turn (default
#          "triton default mosaic"; ~12 s per example each, compiling), at most SWEEP_N examples;
#          the mosaic ones share its pool (PALLAS_FLASH_SWEEP_SHARD); every example logged, not
#          failing, and counted by benchmarks/sweep_summary.py; logs in $OUT/sweep.tgz
#   decode  python -m pallas_flash.bench --suite decode (DECODE_ARGS, e.g. --quick)
#   mla    benchmarks/experiments.py mla
#   extras  python -m pallas_flash.bench --suite overheads: sinks and dropout (HS: head dims)
#   fused  benchmarks/experiments.py fused-dq: the fused dQ against the default backward and
#          cuDNN (FUSED_POINTS: H:SEQ pairs, default its points; MODES: its backwards,
#          comma-separated; MASK: window:W or packed:D, default none; KERNELS=1: kernel times)
#   resources  benchmarks/kernel_resources.py $OUT/resources RESOURCE_CASES (ptxas' registers
#          and spills, SASS counts; default: all its cases)
#   regsplit  benchmarks/register_split.py $OUT/regsplit REGSPLIT_ARGS (e.g. "--kernels forward")
#   tune   python -m pallas_flash.tune (TUNE_ARGS), cache to $OUT/tune.json
#   ncu    benchmarks/ncu_profile.py's NCU_CASES (default: all) under Nsight Compute (NCU_ARGS,
#          default "--set full -k regex:pallas_flash|cudnn": 38 replays per kernel, ours and
#          cuDNN's only; XLA's small kernels took the whole call once), the details page to
#          $OUT/ncu-details.csv and every metric to $OUT/ncu-raw.csv.gz (~30 KB a kernel)
#   anchors  the anchors' tokamax / jax / torch scripts (carry .whl and .anchors)
#   scale  python -m pallas_flash.bench --suite scale on every GPU of the host (SCALE_ARGS)
#   mesh   examples/train_gpt.py on a mesh of the host's GPUs: MESHES holds MESH:BATCH entries
#          (e.g. "context=2:1 data=2:2 none:1"; none = one GPU, no mesh), MESH_ARGS adds flags
# TEST_SPREAD=1 gives each test group one GPU of the host in turn (CUDA_VISIBLE_DEVICES), except
# groups written all:ARGS. TEST_WORKERS=N runs the groups in one pytest over N processes instead
# (TEST_MARK: its marker expression, default gpu); with TEST_IDS=FILE it runs the node ids listed
# in FILE (one per line) instead of TEST_GROUPS, and writes those it did not reach by the cap to
# $OUT/not_reached.txt (`benchmarks/not_reached.py`): the next call's TEST_IDS (carry it in
# benchmarks/scratch). TEST_IDS=all: every gpu-marked test but the property sweeps (the sweep
# stage runs those, with fresh seeds), collected here into $OUT/ids.txt.
# TEST_WORKERS=auto (the default with TEST_IDS) sizes the processes by the GPU's memory:
#   Each pytest process holds its own CUDA context and libraries (~1 GiB outside XLA's
#   allocator), and XLA's allocator without preallocation grows to the largest memory a test of
#   that process ever took and keeps it (its default cap is 75% of the GPU): 15 processes that
#   each once ran a large test outgrow an 80 GB H100 (96 of 318 tests failed there at 15 with
#   RESOURCE_EXHAUSTED or the autotuner's "All configs failed during profiling"), not the
#   141 GB H200. So each process gets a fixed share, TEST_WORKER_GIB (default 9: the H200 ran the
#   suite at 15 processes, 9.4 GiB each), of memory.total less 2 GiB for the driver:
#     workers  = min(cores - 1, floor((total - 2) / 9))
#     fraction = ((total - 2) / workers - 1) / total   (XLA_PYTHON_CLIENT_MEM_FRACTION: the cap)
#   H200, 140.4 GiB, 16 cores: 15 workers capped at 8.2 GiB (0.058);
#   H100, 79.6 GiB, 16 cores:   8 workers capped at 8.7 GiB (0.109).
#   The groups side by side (TEST_WORKERS unset) get the same cap for their count
#   (`benchmarks/gpu_workers.py` does the arithmetic). A test that still runs out of memory is
#   run again alone, uncapped, after the others (TEST_RERUN_TIMEOUT, default 90 s, on top of
#   TEST_TIMEOUT); those the rerun does not reach go to not_reached.txt.
# The whole gpu-marked suite takes ~1300 s of one H200 at TEST_WORKERS=15: three calls.
# TEST_GROUPS entries written any:ARGS run unmarked tests too.
# Everything lands in $OUT; *_TIMEOUT variables cap each stage.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee $OUT/env.txt
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__)" | tee -a $OUT/env.txt
for stage in ${@:-tests masks grid}; do
  echo "== $stage $(date +%T)"
  case $stage in
    tests)
      # The float64 numpy oracle, not the GPU, is the bottleneck: the groups (';'-separated pytest
      # arguments, TEST_GROUPS) run side by side, sharing the GPU without preallocation.
      export XLA_PYTHON_CLIENT_PREALLOCATE=false
      [ -n "${TEST_IDS:-}" ] && TEST_WORKERS=${TEST_WORKERS:-auto}
      if [ -n "${TEST_WORKERS:-}" ]; then
        # The processes and each one's memory cap, by the GPU's memory (the header).
        read -r workers fraction <<< "$(python3 benchmarks/gpu_workers.py size \
          $([ "$TEST_WORKERS" != auto ] && echo "$TEST_WORKERS"))"
        workers=${workers:-$TEST_WORKERS}
        echo "$workers test processes, each capped at ${fraction:-0.75} of the GPU's memory"
        rm -f /tmp/gpu_tests.xml /tmp/memory_failed.txt
        # One pytest spread over TEST_WORKERS processes (pytest-xdist), every group's arguments
        # together; SIGINT at the cap still prints the summary of what ran.
        # One BLAS thread per worker: the oracle's einsums oversubscribe the cores otherwise.
        # Node ids hold spaces and brackets: they go to pytest.main as a list, not through a shell.
        ids_runner="import sys, pytest; ids = [l.strip() for l in open(sys.argv[1]) if l.strip()]; sys.exit(pytest.main(sys.argv[2:] + ids))"
        if [ "${TEST_IDS:-}" = all ]; then
          python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider -p no:benchmark tests \
            2>/dev/null | grep '::' | grep -v property_sweep > $OUT/ids.txt
          TEST_IDS=$OUT/ids.txt
        fi
        if [ -n "${TEST_IDS:-}" ]; then run=(python3 -c "$ids_runner" "$TEST_IDS"); else run=(python3 -m pytest); fi
        OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 \
        XLA_PYTHON_CLIENT_MEM_FRACTION=${fraction:-0.75} \
        timeout -s INT -k 30 ${TEST_TIMEOUT:-280} "${run[@]}" -n $workers -v \
          -m "${TEST_MARK:-gpu}" -p no:cacheprovider -p no:benchmark -rfE --tb=line \
          --junitxml=/tmp/gpu_tests.xml \
          ${TEST_IDS:+--durations=20} $([ -z "${TEST_IDS:-}" ] && echo ${TEST_GROUPS//;/ }) \
          > $OUT/gpu_tests.log 2>&1
        grep -E "FAILED|ERROR|XPASS|passed|failed" $OUT/gpu_tests.log | tail -n 40
        # Tests that ran out of memory beside the others, again alone with the whole GPU.
        [ -f /tmp/gpu_tests.xml ] && python3 benchmarks/gpu_workers.py memory-failures \
          /tmp/gpu_tests.xml > /tmp/memory_failed.txt
        if [ -s /tmp/memory_failed.txt ]; then
          echo "-- $(wc -l < /tmp/memory_failed.txt) out of memory beside the others: alone"
          OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 \
          XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 \
          timeout -s INT -k 30 ${TEST_RERUN_TIMEOUT:-90} python3 -c "$ids_runner" \
            /tmp/memory_failed.txt -n 1 -v -p no:cacheprovider -p no:benchmark -rfE --tb=line \
            > $OUT/gpu_tests_alone.log 2>&1
          grep -E "FAILED|ERROR|XPASS|passed|failed" $OUT/gpu_tests_alone.log | tail -n 20
        fi
        unset XLA_PYTHON_CLIENT_PREALLOCATE
        if [ -n "${TEST_IDS:-}" ]; then
          python3 benchmarks/not_reached.py "$TEST_IDS" $OUT/gpu_tests.log > $OUT/not_reached.txt
          if [ -s /tmp/memory_failed.txt ]; then
            python3 benchmarks/not_reached.py /tmp/memory_failed.txt $OUT/gpu_tests_alone.log \
              >> $OUT/not_reached.txt
          fi
        fi
        continue
      fi
      # The Mosaic forward's files (tests/test_mosaic_forward*.py) make one group: the glob
      # expands where the group's words split (the --ignore-glob word matches no path).
      groups=${TEST_GROUPS:-"tests/test_triton_forward.py;tests/test_triton_backward.py;tests/test_mosaic_forward*.py;tests --ignore=tests/test_triton_forward.py --ignore=tests/test_triton_backward.py --ignore-glob=tests/test_mosaic_forward*.py"}
      IFS=';' read -ra group_list <<< "$groups"
      i=0
      gpus=$(nvidia-smi -L | wc -l)
      # Every group may share one GPU (all:ARGS groups see each one): each is capped at its share.
      read -r _ fraction <<< "$(python3 benchmarks/gpu_workers.py size ${#group_list[@]})"
      export XLA_PYTHON_CLIENT_MEM_FRACTION=$fraction
      for g in "${group_list[@]}"; do
        i=$((i + 1))
        # A group written "all:ARGS" sees every GPU (multi-GPU tests).
        visible=$(( (i - 1) % gpus )); [ "${g#all:}" != "$g" ] && visible=$(seq -s, 0 $((gpus - 1)))
        [ "${TEST_SPREAD:-0}" = 1 ] && export CUDA_VISIBLE_DEVICES=$visible
        # A group written "any:ARGS" runs its tests whatever their marker (CPU tests on the GPU's
        # default backend, e.g. the Flax modules' training steps).
        mark="gpu"; [ "${g#any:}" != "$g" ] && mark="gpu or not gpu"
        g=${g#all:}; g=${g#any:}
        timeout -s INT -k 30 ${TEST_TIMEOUT:-280} python3 -m pytest -q -m "$mark" -p no:cacheprovider -rf \
          --tb=line $g > $OUT/gpu_tests_$i.log 2>&1 &
      done
      wait
      unset XLA_PYTHON_CLIENT_PREALLOCATE XLA_PYTHON_CLIENT_MEM_FRACTION CUDA_VISIBLE_DEVICES
      for f in $OUT/gpu_tests_*.log; do echo "-- $f"; tail -n 6 $f; done ;;
    sweep)
      mkdir -p $OUT/sweep
      # As many processes as the GPU's memory holds (the tests stage's arithmetic), each capped.
      read -r procs fraction <<< "$(python3 benchmarks/gpu_workers.py size ${SWEEP_PROCS:-})"
      read -ra sweep_paths <<< "${SWEEP_PATHS:-triton default mosaic}"
      declare -A sweep_test=([triton]="sweep and triton" [default]="sweep and default"
                             [mosaic]="sweep_mosaic")
      for i in $(seq 0 $((procs - 1))); do
        path=${sweep_paths[$((i % ${#sweep_paths[@]}))]}
        # The mosaic processes' shares of its pool: the k-th of them takes entries k mod m.
        m=$(( (procs - 1 - i % ${#sweep_paths[@]}) / ${#sweep_paths[@]} + 1 ))
        XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=$fraction \
        OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 PALLAS_FLASH_SWEEP=${SWEEP_N:-100} PALLAS_FLASH_SWEEP_SHARD=$((i / ${#sweep_paths[@]}))/$m \
        PALLAS_FLASH_SWEEP_LOG=$OUT/sweep/$i.jsonl \
        timeout -s INT -k 20 ${SWEEP_TIMEOUT:-280} python3 -m pytest -q -m gpu -p no:cacheprovider \
          -p no:benchmark tests/test_property.py -k "${sweep_test[$path]}" \
          > $OUT/sweep/$i.log 2>&1 &
      done
      wait
      python3 benchmarks/sweep_summary.py $OUT/sweep/*.jsonl | tee $OUT/sweep_summary.txt | head -n 40
      tar -czf $OUT/sweep.tgz -C $OUT sweep && rm -rf $OUT/sweep ;;
    masks)
      timeout ${MASKS_TIMEOUT:-150} python3 -m pallas_flash.bench --suite masks \
        --out $OUT/masks.jsonl > $OUT/masks.log 2>&1
      tail -n 12 $OUT/masks.log ;;
    grid)
      timeout ${BENCH_TIMEOUT:-300} python3 -m pallas_flash.bench --out $OUT/bench.jsonl \
        ${BENCH_ARGS:-} > $OUT/bench.log 2>&1
      grep -v "^\[" $OUT/bench.log | tail -n 40 ;;
    compile)
      timeout ${COMPILE_TIMEOUT:-400} python3 -m pallas_flash.bench --suite compile \
        --out $OUT/compile.jsonl ${COMPILE_ARGS:-} > $OUT/compile.log 2>&1
      tail -n 20 $OUT/compile.log ;;
    layers)
      timeout ${LAYERS_TIMEOUT:-240} python3 benchmarks/experiments.py compile-forms \
        --out $OUT/compile-layers.jsonl ${LAYERS_POINTS:+--points $LAYERS_POINTS} 2>&1 | grep "^{" ;;
    tiles|split)
      exp=$([ $stage = tiles ] && echo tiles-masked || echo split-kv)
      timeout ${EXP_TIMEOUT:-150} python3 benchmarks/experiments.py $exp --out $OUT/$exp.jsonl \
        > $OUT/$exp.log 2>&1
      grep -c '"ms"' $OUT/$exp.jsonl ;;
    mosaic)
      timeout ${EXP_TIMEOUT:-150} python3 benchmarks/experiments.py mosaic-tiles \
        --out $OUT/mosaic-tiles.jsonl ${MOSAIC_ARGS:-} > $OUT/mosaic-tiles.log 2>&1
      grep -c '"ms"' $OUT/mosaic-tiles.jsonl ;;
    mosaicbwd)
      timeout ${EXP_TIMEOUT:-150} python3 benchmarks/experiments.py mosaic-backward \
        --out $OUT/mosaic-backward.jsonl ${MOSAIC_ARGS:-} > $OUT/mosaic-backward.log 2>&1
      grep -c '"ms"' $OUT/mosaic-backward.jsonl ;;
    mosaicgqa)
      timeout ${EXP_TIMEOUT:-300} python3 benchmarks/experiments.py mosaic-gqa \
        --out $OUT/mosaic-gqa.jsonl > $OUT/mosaic-gqa.log 2>&1
      grep -c '"ms"' $OUT/mosaic-gqa.jsonl ;;
    decode)
      timeout ${DECODE_TIMEOUT:-300} python3 -m pallas_flash.bench --suite decode \
        --out $OUT/decode.jsonl ${DECODE_ARGS:-} > $OUT/decode.log 2>&1
      sed -n '/^wall time per call/,$p' $OUT/decode.log ;;
    mla)
      timeout ${EXP_TIMEOUT:-150} python3 benchmarks/experiments.py mla --out $OUT/mla.jsonl \
        > $OUT/mla.log 2>&1
      tail -n 4 $OUT/mla.log ;;
    fused)
      timeout ${EXP_TIMEOUT:-150} python3 benchmarks/experiments.py fused-dq --out $OUT/fused.jsonl \
        ${FUSED_POINTS:+--points $FUSED_POINTS} ${MODES:+--modes ${MODES//,/ }} \
        ${MASK:+--mask $MASK} ${KERNELS:+--kernel-time} > $OUT/fused.log 2>&1
      grep summary $OUT/fused.log ;;
    resources)
      timeout ${RESOURCES_TIMEOUT:-240} python3 benchmarks/kernel_resources.py $OUT/resources \
        ${RESOURCE_CASES:-} > $OUT/resources.log 2>&1
      tail -n 30 $OUT/resources.log
      # At most 8 files come back from $OUT: the rows apart, the dumps in one archive.
      cp $OUT/resources/resources.jsonl $OUT/ 2>/dev/null
      tar -czf $OUT/resources.tgz -C $OUT resources && rm -rf $OUT/resources ;;
    regsplit)
      timeout ${REGSPLIT_TIMEOUT:-400} python3 benchmarks/register_split.py $OUT/regsplit \
        ${REGSPLIT_ARGS:-} > $OUT/regsplit.log 2>&1
      grep -v '^WARNING' $OUT/regsplit.log | tail -n 40
      for f in resources timing; do cp $OUT/regsplit/$f.jsonl $OUT/regsplit-$f.jsonl 2>/dev/null; done
      tar -czf $OUT/regsplit.tgz -C $OUT regsplit && rm -rf $OUT/regsplit ;;
    extras)
      timeout ${EXP_TIMEOUT:-150} python3 -m pallas_flash.bench --suite overheads \
        --out $OUT/extras.jsonl ${HS:+--head-dims $HS} > $OUT/extras.log 2>&1
      tail -n 8 $OUT/extras.log ;;
    train)
      bash benchmarks/device_train.sh ;;
    ncu)
      timeout ${NCU_TIMEOUT:-300} ncu --profile-from-start off --clock-control none \
        ${NCU_ARGS:---set full -k regex:pallas_flash|cudnn} -f -o $OUT/ncu python3 benchmarks/ncu_profile.py ${NCU_CASES:-} \
        > $OUT/ncu.log 2>&1
      grep "profiled\|ERROR" $OUT/ncu.log | tail -n 20
      ncu --import $OUT/ncu.ncu-rep --page details --csv > $OUT/ncu-details.csv 2>/dev/null
      ncu --import $OUT/ncu.ncu-rep --page raw --csv 2>/dev/null | gzip > $OUT/ncu-raw.csv.gz
      rm -f $OUT/ncu.ncu-rep ;;
    tune)
      timeout ${TUNE_TIMEOUT:-300} python3 -m pallas_flash.tune --cache $OUT/tune.json \
        --log $OUT/tune.jsonl ${TUNE_ARGS:-} > $OUT/tune.log 2>&1
      tail -n 3 $OUT/tune.log ;;
    anchors)
      # The anchors' peers side by side. Needs carry: [".whl", ".anchors"]: tokamax and
      # its pure-Python dependencies as wheels (.whl/), the anchors' scripts copied to .anchors/
      # (both ignored by git; docs/notes/peers.md, "Rebuilding the anchors' inputs").
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
      timeout ${ANCHORS_TIMEOUT:-300} python3 .anchors/bench_jax.py --hdims ${ANCHOR_HDIMS:-128} \
        --impls tokamax_triton,tokamax_mosaic,jaxref_triton --budget_s 280 \
        --out $OUT/anchors_jax.jsonl \
        > $OUT/anchors_jax.log 2>&1
      timeout ${ANCHORS_TIMEOUT:-300} python3 .anchors/bench_torch.py --out $OUT/anchors_torch.jsonl \
        > $OUT/anchors_torch.log 2>&1
      tail -n 5 $OUT/anchors_jax.log $OUT/anchors_torch.log ;;
    scale)
      timeout ${SCALE_TIMEOUT:-300} python3 -m pallas_flash.bench --suite scale \
        --out $OUT/scale.jsonl ${SCALE_ARGS:-} > $OUT/scale.log 2>&1
      tail -n 25 $OUT/scale.log ;;
    mesh)
      for entry in ${MESHES:-context=2:1 data=2:2 none:1}; do
        spec=${entry%:*}; mesh=""; [ $spec != none ] && mesh="--mesh $spec"
        echo "-- $entry"
        timeout ${MESH_TIMEOUT:-150} python3 examples/train_gpt.py $mesh --batch ${entry#*:} \
          --out $OUT/mesh.jsonl ${MESH_ARGS:-} 2>&1 | grep -E "GPT|summary|step|Error" | tail -4
      done ;;
    *) echo "unknown stage $stage" ;;
  esac
done
echo "== done $(date +%T)"
