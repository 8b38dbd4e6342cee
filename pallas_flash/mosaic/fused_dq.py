"""The fused dQ (`BackwardTiles.fused_dq`): no dQ kernel. The dK/dV kernel's consumers also
compute dQ's partial of each step and add it into dQ by TMA reductions, in arrival order
(`DQSink`): f32 adds ("add", not bitwise deterministic), or int32 adds of fixed-point partials
("fixed": each row's dS scaled by a power of two from a bound on its sums, `mosaic.fixed_point`;
integer adds give the same bits in any order).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash.mosaic import launch
from pallas_flash.mosaic._kernel_common import (
    step_tile,
    step_zero,
    wgmma_zeros,
)


@dataclasses.dataclass(frozen=True)
class DQSink:
    """Where the dK/dV consumers put dQ's partial of each CTA step (tiles.fused_dq), transposed:
    (dS K)^T = K^T dS^T over the CTA's keys for the step's query tile, added by TMA into dq_ref
    [B, N, H, T''] f32 (dQ^T; int32 with "fixed"), or with `slab` (the CTA's kv tile) stored
    into dq_ref[slab] of [kv tiles, B, N, H, T''].

    Every consumer stores its dS^T of each step into its tile of ds_smem (zeros for a step it
    drains), and the partial is summed over every consumer's block of keys: one add of
    [H, block_q_dkv] per CTA step, not one per consumer (half the L2 reduction traffic with two
    consumers). A consumer computes a partial of step s at the start of step s + 1, in the same
    wgmma wait as its S^T there (on its own at a drained step, and after the last step):
    waiting for it on its own, right after dK, stopped the consumer until the tensor cores
    had drained both consumers' queues (docs/notes/fused-dq.md, "How the fused forms work").
    Two ways to share the work:
    - `halves` (`fused_dq_rows`): each consumer computes its half of dQ^T's rows (K's
      columns [c * H / 2, (c + 1) * H / 2) as A) of every step. ds_ready[s % 2] completes when
      both tiles of step s have landed (a prologue of zeros stands for step -1); ds_read[c]
      when the partner has read consumer c's tile, which c waits for before each store.
    - otherwise the consumers take turns: consumer s % consumers computes the whole partial of
      step s. ds_ready[c] completes when the tiles of a step that consumer c computes have
      landed, ds_read[c] when the partner has read c's tile (waited for before c's store at
      the step after one its partner computes). With one consumer neither barrier is needed.

    Transposed because dS^T is what a consumer holds, in registers: Mosaic GPU transposes no
    register tile, and a tile stored from registers cannot be read back as a transposed wgmma
    operand (layout inference finds no layout for both), so dS^T is stored as it is and read as
    B, K's tiles (loaded by TMA) as A transposed. ds_smem [consumers, block_kv_dkv,
    block_q_dkv] (16-bit, swizzled); k_smem [consumers, block_kv_dkv, H], the CTA's keys;
    partial_smem [rows, block_q_dkv] f32 (int32 with "fixed"; rows: H, or H / 2 in halves),
    this consumer's staging tile, one store in flight at a time. cta_tiles, first: the CTA's
    query tiles per head and the first (a step's head and tile)."""

    ds_smem: object
    k_smem: object
    partial_smem: object
    dq_ref: object
    batch: object
    first_head: object
    consumer: object
    cta_tiles: object
    first: object
    ds_ready: object = None  # Barrier(num_arrivals=consumers, num_barriers=consumers), 2 only
    ds_read: object = None  # Barrier(num_arrivals=1, num_barriers=consumers), 2 only
    slab: object = None
    step_descriptors: bool = False  # BackwardTiles.step_descriptors

    @property
    def consumers(self) -> int:
        return self.ds_smem.shape[0]

    @property
    def halves(self) -> bool:
        return self.partial_smem.shape[0] < self.k_smem.shape[-1]

    def _computes(self, step):
        """Whether this consumer computes (its rows of) CTA step `step`'s partial: always in
        halves or alone, on its turns otherwise."""
        if self.halves or self.consumers == 1:
            return True
        return lax.rem(step, jnp.int32(self.consumers)) == self.consumer

    def _partner_reads(self, step):
        """Whether the partner reads this consumer's tile of CTA step `step` (two consumers)."""
        return True if self.halves else jnp.logical_not(self._computes(step))

    def _adds_before(self, step):
        """Whether this consumer adds a partial of step - 1 at CTA step `step` (>= 0)."""
        return (step >= 1) & self._computes(step - 1)

    def start(self):
        """Before the first step. Halves: step -1's tiles are zeros (its partial is computed,
        never added), so that every step computes the partial of the one before."""
        if self.halves:
            self.ds_smem.at[self.consumer][...] = wgmma_zeros(self.ds_smem.shape[1:]).astype(
                self.ds_smem.dtype
            )
            plgpu.commit_smem()
            plgpu.barrier_arrive(self.ds_ready.at[1])

    def put(self, ds_t, step):
        """This consumer's dS^T of CTA step `step`: 16-bit registers [keys, rows], or None for
        a step outside its range (zeros)."""
        if self.halves:
            # The partner has read this tile of the step before (of step -1 at step 0).
            plgpu.barrier_wait(self.ds_read.at[self.consumer])
        elif self.consumers > 1:
            read = (step >= 1) & self._partner_reads(step - 1)
            pl.when(read)(lambda: plgpu.barrier_wait(self.ds_read.at[self.consumer]))
        tile = self.ds_smem.at[self.consumer]
        if ds_t is None:
            ds_t = wgmma_zeros(tile.shape).astype(tile.dtype)
        tile[...] = ds_t
        plgpu.commit_smem()
        if self.consumers > 1:
            plgpu.barrier_arrive(self.ds_ready.at[lax.rem(step, jnp.int32(self.consumers))])

    def issue(self, acc_ref, zero):
        """The wgmmas of dQ^T's partial (this consumer's rows) into acc_ref; the tiles at
        block + zero (`step_zero`)."""
        rows = self.partial_smem.shape[0]
        for block in range(self.consumers):
            k_t = self.k_smem.at[block + zero]
            if self.halves:
                k_t = k_t.at[:, pl.ds(self.consumer * rows, rows)]
            plgpu.wgmma(acc_ref, k_t.T, self.ds_smem.at[block + zero])

    def _wait_tiles(self, step):
        """Until every consumer's tile of CTA step `step` has landed."""
        if self.consumers > 1:
            ready = lax.rem(step + 2, jnp.int32(2)) if self.halves else self.consumer
            plgpu.barrier_wait(self.ds_ready.at[ready])

    def _read_done(self):
        if self.consumers > 1:
            plgpu.barrier_arrive(self.ds_read.at[1 - self.consumer])

    def with_st(self, st_issue, st_shape, step, zero):
        """At a computed CTA step `step`: S^T (st_issue(acc_ref) issues its wgmma), in the same
        wait as this consumer's partial of step - 1 where it has one, which is then added;
        returns S^T."""

        def with_partial():
            self._wait_tiles(step - 1)

            def both(refs):
                st_ref, dq_ref = refs
                st_issue(st_ref)
                self.issue(dq_ref, zero)

            s_t, partial = pl.run_state(both)(
                (
                    plgpu.ACC.init(wgmma_zeros(st_shape)),
                    plgpu.ACC.init(wgmma_zeros(self.partial_smem.shape)),
                )
            )
            self._read_done()
            if self.halves:  # step -1's partial (zeros) is computed, not added
                pl.when(step >= 1)(lambda: self._store(partial, step - 1))
            else:
                self._store(partial, step - 1)
            return s_t

        if self.halves:
            return with_partial()

        def alone():
            def st_into(acc_ref):
                st_issue(acc_ref)
                return acc_ref[...]

            return pl.run_scoped(st_into, plgpu.ACC(st_shape, jnp.float32))

        return lax.cond(self._adds_before(step), with_partial, alone)

    def drained(self, step):
        """At a CTA step `step` this consumer drains: its partial of step - 1 on its own."""
        if self.halves:
            partial = self._compute(step - 1)
            pl.when(step >= 1)(lambda: self._store(partial, step - 1))
        else:
            pl.when(self._adds_before(step))(lambda: self._add(step - 1))

    def _compute(self, step):
        """This consumer's partial of CTA step `step`, waited for."""
        self._wait_tiles(step)

        def dq_into(acc_ref):
            self.issue(acc_ref, step_zero(step, self.step_descriptors))
            return acc_ref[...]

        partial = pl.run_scoped(dq_into, plgpu.ACC(self.partial_smem.shape, jnp.float32))
        self._read_done()
        return partial

    def _add(self, step):
        self._store(self._compute(step), step)

    def _head_tile(self, step):
        """(query head, query tile) of CTA step `step`."""
        head = self.first_head + lax.div(step, self.cta_tiles)
        return head, step_tile(step, self.first, self.cta_tiles)

    def _store(self, partial, step):
        """Adds this consumer's partial of CTA step `step` into dQ^T (or stores it into its
        slab)."""
        rows, block_q = self.partial_smem.shape
        head, q_tile = self._head_tile(step)
        # The previous add of this consumer must have read the staging tile.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        if self.partial_smem.dtype == jnp.int32:
            # fused_dq "fixed": to int32 (truncated), in the units its dS^T was scaled to.
            partial = launch.truncate_to_int32(partial)
        self.partial_smem[...] = partial
        plgpu.commit_smem()
        first_row = self.consumer * rows if self.halves else 0
        window = (self.batch, head, pl.ds(first_row, rows), pl.ds(q_tile * block_q, block_q))
        if self.slab is not None:
            plgpu.copy_smem_to_gmem(self.partial_smem, self.dq_ref.at[(self.slab, *window)])
            return
        plgpu.copy_smem_to_gmem(self.partial_smem, self.dq_ref.at[window], reduction_op="add")

    def finish(self, steps):
        """After the last of `steps` CTA steps, before this consumer's K buffer is overwritten:
        the last step's partial, then the partner's last read of this consumer's tile (and
        K), where it has one."""
        last = steps - 1
        pl.when((steps > 0) & self._computes(last))(lambda: self._add(last))
        if self.consumers > 1:
            partner_read = (steps > 0) & self._partner_reads(last)
            pl.when(partner_read)(lambda: plgpu.barrier_wait(self.ds_read.at[self.consumer]))
