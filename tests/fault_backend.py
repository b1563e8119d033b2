"""A backend that injects faults tied to chosen requests, around a real one.

``FaultInjectingBackend(real)`` delegates every step to ``real`` except when a
chosen request is scheduled in it:

- ``raise_for``: the step raises (as a device error or a bad per-request
  value deep in the forward pass would), whatever else shares the batch;
- ``hang_for``: the step blocks until ``release`` is set (a hung kernel),
  then raises;
- ``nan_for``: the request's cached keys and values are overwritten with NaN
  before a decode step, so its logits (and only its) come out NaN, as from a
  corrupted KV block or an overflow in its own activations.
"""

from __future__ import annotations

import threading

from backends.interface import SchedulerOutput, StepResult


class InjectedFault(RuntimeError):
    pass


class FaultInjectingBackend:
    def __init__(self, real) -> None:
        self.real = real
        self.num_kv_blocks = real.num_kv_blocks
        self.block_size = real.block_size
        self.raise_for: set[str] = set()
        self.hang_for: set[str] = set()
        self.nan_for: set[str] = set()
        # A request whose prompt holds this token id becomes a culprit of
        # ``raise_for`` (for requests whose ids the gateway makes up).
        self.poison_token: int | None = None
        self.fail_every_step = False
        self.release = threading.Event()
        self.hung = threading.Event()  # set once a step has started to hang
        self.num_steps = 0

    def execute(self, output: SchedulerOutput) -> StepResult:
        self.num_steps += 1
        ids = {r.request_id for r in output.requests}
        for row in output.requests:
            if row.prompt_token_ids and self.poison_token in row.prompt_token_ids:
                self.raise_for.add(row.request_id)
        if self.fail_every_step and output.requests:
            raise InjectedFault("injected fault: every step fails")
        culprits = ids & self.raise_for
        if culprits:
            raise InjectedFault(f"injected fault for {sorted(culprits)}")
        if ids & self.hang_for:
            self.hung.set()
            self.release.wait(60.0)
            raise InjectedFault("a hung step came back")
        for row in output.requests:
            if row.request_id in self.nan_for and len(row.token_ids) == 1 and row.start_pos:
                self._poison(row.block_table, row.start_pos)
        return self.real.execute(output)

    def _poison(self, block_table: list[int], num_cached: int) -> None:
        bs = self.block_size
        slots = [block_table[p // bs] * bs + p % bs for p in range(num_cached)]
        for k_cache, v_cache in self.real.kv_caches:
            k_cache[slots] = float("nan")
            v_cache[slots] = float("nan")

    def request_state_ids(self) -> set[str]:
        return self.real.request_state_ids()

    def shutdown(self) -> None:
        self.release.set()
        self.real.shutdown()


def inject_faults(core) -> FaultInjectingBackend:
    """Put a FaultInjectingBackend between ``core`` and its backend."""
    backend = FaultInjectingBackend(core.backend)
    core.backend = backend
    return backend
