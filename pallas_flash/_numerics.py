"""Numeric constants shared by every kernel (Triton and Mosaic GPU), free of any backend import."""

from __future__ import annotations

import numpy as np

LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)
LN2 = 0.6931471805599453  # ln(2): converts a base-2 logsumexp back to natural log

# The online softmax's running max starts here, below every finite logit and finite itself:
# masked logits are -inf, so (masked - max) is -inf and exp2 gives exactly 0, never -inf - -inf;
# a row whose keys all carry a logit of finfo.min still gets their softmax.
MIN_LOGIT = float(np.finfo(np.float32).min)

# Masked logits of the Mosaic forward, which keeps one fused multiply-add per logit: finite, so
# that max/subtract never meet -inf - -inf; that kernel zeroes the probabilities of masked
# entries where a row can start empty, so such a row keeps l == 0.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
