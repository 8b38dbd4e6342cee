"""What the tests share, by what it is (imported as `support.<module>`: pyproject's pytest
`pythonpath` puts tests/ on sys.path):

- backends: the backend matrix (`BACKEND_PATHS`, `backend_paths`), the Triton kernels' modes,
  `has_gpu` / `has_hopper`, PALLAS_FLASH_SWEEP;
- inputs: `Problem`, random inputs with their float64 copies, segment ids, tile sizes, case ids;
- oracle: the float64 oracle (with dropout's keep-mask too), a case's dense visibility, and plain
  attention in the input dtype (the tolerance baseline);
- tolerance: the tolerance rule, bitwise equality, and a closeness check of finite values;
- calls: a function's outputs and gradients in one jitted call;
- mosaic_interpret: jax's Mosaic GPU interpreter with the shims our kernels need;
- kernels: the Mosaic GPU wrappers called with their options spelled out;
- mosaic_forward, mosaic_backward: what the Mosaic GPU kernels' test files share (the kernels as
  functions of a `Problem`, their checks against the oracle, masked cases, cases at a value head
  dim of their own, markers);
- flax_layers: what the Flax layer tests share;
- sharding: what the mesh tests share (the 8-CPU-device child process's flags, inputs, the
  loss, the closeness check, the collectives in compiled HLO);
- ragged: what the ragged paged attention tests share (a batch, its inputs, the float64 oracle,
  the check);
- huge_logits: the tied huge-logits case and its check (the NaN-safety and ring attention tests);
- examples: the examples loaded as modules;
- doc_blocks: the ```python blocks of README.md and docs/*.md, and their runner.

Fixtures and pytest hooks live in tests/conftest.py, never imported as a module.
"""
