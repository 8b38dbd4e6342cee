"""Run the Pallas Mosaic GPU kernels on a CPU: jax's Mosaic GPU interpreter, with three shims.

jax 0.11.2 ships an interpreter for Pallas GPU kernels (`force_gpu_interpret_mode`): it runs each
warpgroup as a thread over simulated GMEM/SMEM, barriers and TMA copies, with a happens-before
race detector. It lacks what attention kernels need most, so `interpret_mosaic()` patches, for
its duration only:

- wgmma: `pl.run_scoped` / `pl.run_state` over WGMMA accumulators and `plgpu.wgmma` become plain
  float32 values and `jnp.dot`s that read A and B from SMEM at their place in program order
  (race-checked). Faithful for our kernels, which wait for every wgmma before the next barrier
  arrive; wgmma's layouts and asynchrony are not simulated.
- TMA write checks against the issuing thread's generic-proxy clock: the shimmed wgmma reads
  are generic-proxy reads, where the hardware's are async-proxy ones; the barrier
  happens-before relations are kept.
- `pallas_flash.mosaic.fixed_point.fixed_point_scales` takes its jnp form: the interpreter
  would take its Triton-lowered kernels too, and runs no Triton (test_mosaic_fixed_point runs
  them in Pallas' own interpreter against that form).
- `pallas_flash.mosaic.launch.truncate_to_int32` (inline Mosaic GPU code, which the
  interpreter does not run) becomes the plain cast (its clamps and NaN -> 0 touch only
  values whose rows the caller makes NaN or 0).
- Barrier deallocation with phases unobserved by some thread is allowed (the interpreter's rule,
  not the hardware's): a producer does not wait for the free phases of the last ring slots.

`oob_fill` replaces the zeros that a TMA load reads past an array's end (the hardware's
OOBFillMode.ZEROS) by another value: garbage there must not reach any kept output.

A barrier wait that sees no arrival for `deadlock_s` seconds raises (the interpreter would
wait forever): a protocol bug, such as a consumer skipping the steps it drains, fails the test
instead of hanging it.

What this checks: the kernels' tiling, masking, online softmax, barrier protocol (a wrong
arrival count or a missing wait deadlocks or races here too) and outputs against the float64
oracle. What it cannot: register and shared-memory budgets, wgmma layouts, ptxas -- those need
the GPU (tests marked gpu) or the lowering tests.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import jax
import jax.numpy as jnp
from jax._src.pallas.mosaic_gpu import core as mosaic_gpu_core
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, shared_memory
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import (
    reset_gpu_interpret_mode_state,
)
from jax._src.pallas.mosaic_gpu.interpret.params import (
    InterpretGPUParams,
    force_gpu_interpret_mode,
)
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash.mosaic import fixed_point
from pallas_flash.mosaic import launch as mosaic_launch


class _Accumulator:
    """A WGMMA accumulator as a value: `acc[...]` reads it, `_wgmma` adds to it."""

    def __init__(self, value):
        self.value = value

    def __getitem__(self, index):
        return self.value


def _wgmma(acc, a, b, **kwargs):
    if not _is_value(a):  # A from SMEM; from registers it is a value already
        a = a[...]
    acc.value = acc.value + jnp.dot(a, b[...], preferred_element_type=jnp.float32)


def _is_value(x) -> bool:
    """An array value, as opposed to an SMEM ref (its aval wraps an inner aval) or a view of one
    (a transformed ref)."""
    return not hasattr(x, "transforms") and not hasattr(getattr(x, "aval", None), "inner_aval")


class _DeadlineCondition(threading.Condition):
    """A barrier's condition variable whose unbounded waits give up after `deadline_s` seconds
    without a notification (the interpreter then fails the kernel and wakes every waiter)."""

    def __init__(self, deadline_s: float):
        super().__init__()
        self.deadline_s = deadline_s

    def wait(self, timeout=None):
        if timeout is not None:
            return super().wait(timeout)
        if not super().wait(self.deadline_s):
            raise RuntimeError(
                f"a barrier wait saw no arrival for {self.deadline_s} s: deadlock "
                "(a thread waits for a phase that no thread will complete)"
            )
        return True


def _patches(deadlock_s: float, oob_fill):
    real_run_scoped = pl.run_scoped
    real_run_state = pl.run_state
    real_barrier_init = shared_memory.Barrier.__init__
    real_scales = fixed_point.fixed_point_scales

    def barrier_init(self, *args, **kwargs):
        real_barrier_init(self, *args, **kwargs)
        self.cv = _DeadlineCondition(deadlock_s)

    def run_scoped(body, *types, **kwargs):
        if (
            types
            and not kwargs
            and all(isinstance(t, mosaic_gpu_core.WGMMAAccumulatorRef) for t in types)
        ):
            return body(*[_Accumulator(jnp.zeros(t.shape, t.dtype)) for t in types])
        return real_run_scoped(body, *types, **kwargs)

    def run_state(body):
        def run(init):
            is_acc = lambda x: isinstance(x, mosaic_gpu_core.WGMMAAccumulatorRef)  # noqa: E731
            leaves, tree = jax.tree.flatten(init, is_leaf=is_acc)
            if not all(is_acc(leaf) for leaf in leaves):  # state of arrays, not accumulators
                return real_run_state(body)(init)
            accs = [_Accumulator(leaf._init) for leaf in leaves]
            body(jax.tree.unflatten(tree, accs))
            return jax.tree.unflatten(tree, [acc.value for acc in accs])

        return run

    def post_read(self, tma_thread_id, memory):
        if memory.detect_races:
            self.clock.inc(tma_thread_id)
            gpu_callbacks.get_races().check_write(
                self.thread,
                self.clock.generic_clock.copy(),
                self.dst_allocation_key,
                self.dst_access,
                source_info=self.source_info,
            )

    def deallocate(self):
        with self.cv:
            self.ref_count -= 1
            if self.ref_count == 0 and self.arrivals_count != 0:
                raise ValueError(f"Barrier deallocated with {self.arrivals_count} arrivals pending")

    return [
        (pl, "run_scoped", run_scoped),
        (pl, "run_state", run_state),
        (plgpu, "wgmma", _wgmma),
        (gpu_callbacks.AsyncCopyGmemToSmemTask, "post_read", post_read),
        (shared_memory.Barrier, "deallocate", deallocate),
        (shared_memory.Barrier, "__init__", barrier_init),
        (gpu_callbacks.AsyncCopyGmemToSmemTask, "out_of_bounds_source_fill", oob_fill),
        # The interpreter runs no inline Mosaic GPU code: the conversion that the kernels
        # write as one (to skip Pallas' clamps) is the plain cast here.
        (mosaic_launch, "truncate_to_int32", lambda x: x.astype(jnp.int32)),
        # Garbage where the GPU leaves an output uninitialised: NaN, which the oracle tests
        # see wherever a kernel leaves part of it unwritten (the CPU's `lax.empty` is zeros).
        (mosaic_launch, "uninitialised", lambda shape, dtype: jnp.full(shape, jnp.nan, dtype)),
        (fixed_point, "fixed_point_scales", functools.partial(real_scales, kernels=False)),
    ]


@contextlib.contextmanager
def interpret_mosaic(*, warpgroups: int = 3, deadlock_s: float = 30.0, oob_fill=0):
    """Within the block, Mosaic GPU kernels run in the (patched) interpreter with the race
    detector on; on exit, asserts that no race was found in any kernel that ran. A barrier wait
    without an arrival for `deadlock_s` seconds raises. TMA loads read `oob_fill` past an
    array's end."""
    saved = []
    # The interpreter starts a race state per kernel (and drops the last one's): keep each,
    # so that a race in the first of two kernels (the backward's dK/dV) is not lost.
    race_states = []
    real_race_state = gpu_callbacks.GPURaceDetectionState

    def race_state(*args, **kwargs):
        state = real_race_state(*args, **kwargs)
        race_states.append(state)
        return state

    patches = [
        *_patches(deadlock_s, oob_fill),
        (gpu_callbacks, "GPURaceDetectionState", race_state),
    ]
    try:
        for owner, name, replacement in patches:
            saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, replacement)
        reset_gpu_interpret_mode_state()
        params = InterpretGPUParams(detect_races=True, num_cores_or_threads=warpgroups)
        with force_gpu_interpret_mode(params):
            yield
        found = [i for i, state in enumerate(race_states) if state.races_found]
        assert not found, f"the race detector found a data race in kernel run(s) {found}"
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
        reset_gpu_interpret_mode_state()
