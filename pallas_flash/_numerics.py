"""Numeric constants shared by every kernel (Triton and Mosaic GPU), free of any backend import."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)
LN2 = 0.6931471805599453  # ln(2): converts a base-2 logsumexp back to natural log

# The online softmax's running max starts here, below every finite logit and finite itself:
# masked logits are -inf, so (masked - max) is -inf and exp2 gives exactly 0, never -inf - -inf;
# a row whose keys all carry a logit of finfo.min still gets their softmax.
MIN_LOGIT = float(np.finfo(np.float32).min)

# A backward recomputes P = exp2(s * unit2 - lse2) from the saved lse in log2 units: one float32
# rounded several times (the forward's row max and log-sum, the change of units), against an s
# recomputed by another matmul. The exponent of a row's largest logit is then off by a few ulps
# of lse2, which once |lse| passes ~1e6 turns that row's P of 1 into anything from 0 to
# overflow. The Mosaic backward clamps P at 1 and lowers its reference by this many ulps
# (relative): that exponent lands on the clamp, so P of a row with one dominant logit is exactly
# 1 at any magnitude; elsewhere P is high by at most a factor exp2(2 * BACKWARD_SLACK * |lse2|)
# (3e-5 at |lse| = 10, far below a 16-bit dS's rounding).
BACKWARD_SLACK = 2.0**-20


def lowered_reference(lse2):
    """lse2 (float32, log2 units) lowered by BACKWARD_SLACK of its magnitude."""
    return lse2 - jnp.abs(lse2) * BACKWARD_SLACK
