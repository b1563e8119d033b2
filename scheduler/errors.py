"""Errors of the engine loop: they belong to the engine, not to a backend.

Request validation errors (``InvalidRequestError``) stay in backends/errors.py
because SamplingParams, which lives beside the Backend protocol, raises them.
"""

from __future__ import annotations

from backends.errors import BatonError


class EngineDeadError(BatonError):
    """The engine loop has stopped; no request can be served."""


class EngineFaultError(BatonError):
    """An engine step failed for a request (its own fault, or a fault that
    could not be traced to fewer requests); that request ends with it."""


class StepTimeoutError(EngineFaultError):
    """The backend did not finish a step within the step timeout; the step
    was abandoned (its thread cannot be stopped) and retried without it."""
