"""`Call`: the static facts of one attention call that the choice of kernels reads."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_flash.masks import MaskSpec


@dataclasses.dataclass(frozen=True, kw_only=True)
class Call:
    """Shapes, dtype and options of a canonical call (batched, validated by the API).

    Attributes:
      q_shape: (B, T, N, H) of the queries.
      k_shape: (B, S, K, H) of the keys.
      dtype: the arrays' dtype.
      spec: who sees whom (causal, window, segment ids or lengths, dense mask shape).
      soft_cap: the logits' soft cap, or None.
      has_bias: whether a bias is added to the logits.
      dropout_rate: the attention dropout's rate (0: none).
      value_head_dim: Hv of the values (B, S, K, Hv) and the output; None: H.
      deterministic_grads: whether the gradients must be bitwise the same on every run (False
        lets the Hopper backward add dQ's partials in the order they arrive).
      lengths_only: whether the segment arrays the spec has (`spec.has_segments`) hold
        sequence lengths only, no segment ids: every row then sees a prefix of the keys (False
        where that is not known: the arrays may hold any ids).
    """

    q_shape: tuple[int, int, int, int]
    k_shape: tuple[int, int, int, int]
    dtype: jnp.dtype
    spec: MaskSpec
    soft_cap: float | None = None
    has_bias: bool = False
    dropout_rate: float = 0.0
    value_head_dim: int | None = None
    deterministic_grads: bool = True
    lengths_only: bool = False

    def __post_init__(self):
        object.__setattr__(self, "q_shape", tuple(int(d) for d in self.q_shape))
        object.__setattr__(self, "k_shape", tuple(int(d) for d in self.k_shape))
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        if self.value_head_dim is not None:
            hv = int(self.value_head_dim)
            object.__setattr__(self, "value_head_dim", None if hv == self.head_dim else hv)

    @property
    def v_head_dim(self) -> int:
        return self.head_dim if self.value_head_dim is None else self.value_head_dim

    def common_head_dim(self) -> Call:
        """This call with q, k and v at one head dim, max(H, Hv): how the Triton backward, which
        takes a single head dim, runs it (zero columns leave q.k and P.V unchanged)."""
        if self.value_head_dim is None:
            return self
        h = max(self.head_dim, self.value_head_dim)
        return dataclasses.replace(
            self,
            q_shape=(*self.q_shape[:3], h),
            k_shape=(*self.k_shape[:3], h),
            value_head_dim=None,
        )

    @property
    def head_dim(self) -> int:
        return self.q_shape[3]

    @property
    def q_len(self) -> int:
        return self.q_shape[1]

    @property
    def kv_len(self) -> int:
        return self.k_shape[1]

    @property
    def masked(self) -> bool:
        """Whether a bias or dense mask adds a [T, S] operand tile to each pipeline stage."""
        return self.has_bias or self.spec.mask_shape is not None
