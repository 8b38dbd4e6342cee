#!/usr/bin/env bash
# One device call for the end-to-end training table: the GPT3-1.3B-shaped model (24 layers, hidden
# 2048, 16 heads of 128) trained with pallas_flash, cuDNN and XLA attention from the same seed, at
# sequence 2k and 8k. Per-step losses and a summary line per run go to $OUT/train.jsonl.
# Knobs: SEQS ("2048 8192"), STEPS (12), ATTENTIONS ("pallas_flash cudnn xla xla+remat");
# "NAME+remat" adds --remat-attention (XLA attention runs out of memory at 8k without it).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
for seq in ${SEQS:-2048 8192}; do
  batch=$(( 8192 / seq )); [ $batch -lt 1 ] && batch=1
  for attention in ${ATTENTIONS:-pallas_flash cudnn xla xla+remat}; do
    flags=""; [ "${attention#*+}" = remat ] && flags="--remat-attention"
    timeout ${RUN_TIMEOUT:-240} python3 examples/train_gpt.py --preset gpt3-1.3b --seq $seq \
      --batch $batch --steps ${STEPS:-12} --log-every 4 --attention ${attention%+*} $flags \
      --matmul-tflops 718 --out $OUT/train.jsonl 2>&1 | grep -E "GPT|summary|step|Error" | tail -4
  done
done
