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
FLOAT32_MAX = float(np.finfo(np.float32).max)

# A backward recomputes P = exp(s * unit - lse) from the saved lse: one float32 rounded several
# times (the forward's row max and log-sum, a change of units), against an s recomputed by
# another matmul. The exponent of a row's largest logit is then off by an ulp or so of lse, which
# once |lse| passes ~1e6 turns that row's P of 1 into anything from 0 to overflow. Both
# backwards clamp P at 1 and lower their reference by BACKWARD_SLACK (relative) of the part of
# |lse| beyond SLACK_FROM: that exponent lands on the clamp, so P of a row with one dominant
# logit is exactly 1 at any magnitude. Every other key's P is high by the factor
# exp(BACKWARD_SLACK * (|lse| - SLACK_FROM)), which matters where a row spreads over keys near
# its max at a large |lse| (a float16 bias of finfo.min on a whole row: 1.5% there): the slack
# is the smallest tried that keeps every huge-logit and tie test exact, in the interpreters and
# compiled on the H200 (2 to 4 ulps of lse; 8 to 16 put that float16 row 6% high). Rows of
# |lse| <= SLACK_FROM (float32 gradients of ordinary attention among them) are exact: there a
# few ulps of lse move P by under 1e-3 of its value and the clamp alone keeps it finite.
BACKWARD_SLACK = 2.0**-22
SLACK_FROM = 1024.0


def accumulation_dtype(dtype):
    """The dtype the softmax, lse and the accumulators run in for inputs of `dtype`: float32
    (float16, bfloat16 and float32 inputs), float64 for float64 inputs (jax_enable_x64)."""
    return jnp.promote_types(dtype, jnp.float32)


def slack(lse):
    """How far (natural log) a backward lowers its reference below a row's max: BACKWARD_SLACK
    of the part of |lse| (float32) beyond SLACK_FROM."""
    return jnp.maximum(jnp.abs(lse) - SLACK_FROM, 0.0) * BACKWARD_SLACK


def lowered_reference(lse):
    """lse (float32, natural log) lowered by its `slack`, held at MIN_LOGIT: a row whose max is
    a bias of finfo.min would otherwise get -inf, and its keys at -inf (a bias of -inf beside
    it) -inf - -inf, a NaN, instead of P = 0."""
    return jnp.maximum(lse - slack(lse), MIN_LOGIT)


def probability_bound(log_sum, lse):
    """The clamp of a backward's recomputed P in log2 units, float32 shaped as lse: -log2 of each
    row's softmax denominator relative to its max (log_sum, a forward's), so P <= 1 / l and keys
    that tie at the max get exactly 1 / n; 0 (P <= 1) without log_sum."""
    dtype = accumulation_dtype(lse.dtype)
    if log_sum is None:
        return jnp.zeros(lse.shape, dtype)
    return log_sum.astype(dtype) * -LOG2E


def merge_weights(lse, log_sum, axis: int, maxima=None):
    """(weights, log_sum) of a softmax whose keys are split in parts along `axis` of lse and
    log_sum (float32, each part's own): each part's weight in the merged output (its share of
    the summed denominators, relative to the largest of the parts' maxima) and the merged
    softmax's log_sum, relative to that largest max. maxima: the parts' row maxima (natural
    log), or None for lse - log_sum (close: lse rounds log_sum away only where the max's ulp
    exceeds it, but off by an ulp of lse). lse alone would weigh parts whose denominators its
    rounding lost (keys tying at |logits| beyond ~1e6) equally. Parts that see no key (lse =
    -inf) weigh 0; rows that no part sees get weights 0 and log_sum 0."""
    seen = jnp.isfinite(lse)
    row_max = jnp.where(seen, lse - log_sum if maxima is None else maxima, -jnp.inf)
    top = jnp.max(row_max, axis=axis, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    shares = jnp.where(seen, jnp.exp(jnp.where(seen, row_max - top + log_sum, 0.0)), 0.0)
    total = jnp.sum(shares, axis=axis, keepdims=True)  # >= 1 wherever a part sees a key
    weights = shares / jnp.where(total > 0.0, total, 1.0)
    return weights, jnp.log(jnp.maximum(jnp.squeeze(total, axis), 1.0))


def log_sum_with_sinks(lse, log_sum, sinks, maxima=None):
    """log_sum of rows with lse (keys only) after adding the sink logits (broadcast against
    lse[..., 0]: [N] or [B, N]): the merge of the keys with the sink as a part of its own
    (log_sum 0), relative to the larger of the keys' max and the sink. Rows that see no key: 0.
    maxima: the keys' row maxima (natural log), or None for lse - log_sum (`merge_weights`)."""
    dtype = accumulation_dtype(lse.dtype)
    sinks = jnp.broadcast_to(jnp.asarray(sinks, dtype)[..., None], lse.shape)
    parts = jnp.stack([lse, sinks]), jnp.stack([log_sum, jnp.zeros_like(log_sum)])
    if maxima is not None:
        maxima = jnp.stack([maxima, sinks])
    return merge_weights(*parts, axis=0, maxima=maxima)[1]


def sink_probability(sinks, lse, log_sum=None):
    """Each row's sink probability P_sink [..., T] (float32), of a softmax whose lse [..., T]
    includes the sinks (broadcast against lse[..., 0]). log_sum: its log denominator relative
    to the larger of the keys' max and the sink (a forward's), or None for 0. P_sink =
    exp(sink - top - log_sum), top = lse - log_sum: where float32's lse rounds log_sum away (a
    sink tied with a max beyond ~1e6) that top is still the max itself, and P_sink its share
    of the denominators, not exp(sink - lse). 1 for a row that sees no key (lse = sink, also
    for a sink of -inf) and for a sink of +inf; 0 for a sink of -inf in a row with keys."""
    lse = lse.astype(accumulation_dtype(lse.dtype))
    sinks = jnp.broadcast_to(jnp.asarray(sinks, lse.dtype)[..., None], lse.shape)
    log_sum = jnp.zeros_like(lse) if log_sum is None else log_sum.astype(lse.dtype)
    both = jnp.isfinite(lse) & jnp.isfinite(sinks)
    gap = jnp.where(both, (sinks - (lse - log_sum)) - log_sum, 0.0)
    return jnp.where(both, jnp.exp(jnp.minimum(gap, 0.0)), jnp.where(lse == sinks, 1.0, 0.0))


def sink_in_units(sink, unit: float):
    """An attention sink (natural log) in a kernel's units (natural = u * unit), held at
    float32's largest: a finite sink beyond float32 over the scale (1e38 at H = 64 is 8e38
    units) would otherwise be inf, and inf - inf a NaN. One far below float32 there is -inf,
    as a sink of -inf: it takes no share of a row that sees a key."""
    return jnp.minimum(sink * (1.0 / unit), FLOAT32_MAX)


def sink_against_keys(m_keys, l_keys, sink, unit: float, unit2: float | None = None):
    """An epilogue's attention sink (a float32 scalar, natural log) against its rows' largest
    logit m_keys (in the kernel's units: natural = u * unit; >= MIN_LOGIT, finite) and their
    softmax denominator l_keys (relative to m_keys; 0 for rows that saw no key): (m, keys_share,
    l, top), m the larger of the two in those units (`sink_in_units`), keys_share = exp(m_keys
    - m) that the keys' terms take, l the denominator with the sink's term relative to m, and
    top the larger in natural log, which lse adds log l to.

    top is the sink itself where it is the larger, so lse stays the sink's, not the held
    value's. A row that saw no key has the sink as its only term, l = 1 and lse = the sink, also
    for a finite sink that is -inf in the kernel's units (float64's lse, and a finite d sinks);
    a sink of -inf leaves every row as it is. unit2: the kernel's own unit * log2(e)
    (exp2((u - m) * unit2) == exp(logit - max)), not multiplied where it is 1. unit may be a
    traced float32 scalar (a float8 cache's key scale folded in)."""
    unit2 = unit * LOG2E if unit2 is None else unit2
    sink_u = sink_in_units(sink, unit)
    m = jnp.maximum(m_keys, sink_u)

    unit_one = isinstance(unit2, (int, float)) and unit2 == 1.0  # unit may be traced

    def log2_share(x):
        return jnp.exp2(x if unit_one else x * unit2)

    keys_share, sink_share = log2_share(m_keys - m), log2_share(sink_u - m)
    empty = l_keys == 0.0
    sink_share = jnp.where(empty & (sink > -jnp.inf), 1.0, sink_share)
    top = jnp.where((sink_u > m_keys) | empty, sink, m_keys * unit)
    return m, keys_share, l_keys * keys_share + sink_share, top
