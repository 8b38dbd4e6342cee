"""Numeric constants shared by every kernel (Triton and Mosaic GPU), free of any backend import."""

from __future__ import annotations

import numpy as np

LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)
LN2 = 0.6931471805599453  # ln(2): converts a base-2 logsumexp back to natural log

# Masked logits. Finite, so that max/subtract never meet -inf - -inf; the kernels also zero the
# probabilities of masked entries explicitly, so a row that has seen no key yet keeps l == 0.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
