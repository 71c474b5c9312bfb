"""Least-squares fit of the step-cost coefficients to timed steps, none of them negative: steps timed
in process (sim/calibrate.py) or as the engine service ran them (its `GET /v1/steps`, served_steps.py)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvmesh.policies.step_shape import FIELDS

from .step_cost import TERMS, StepCost
from .tier_copies import CopyRate

COLUMNS = (*FIELDS, "staged_bytes")  # a timed step's row: its shape, then the bytes its staging area copied
Row = tuple[float, ...]              # as COLUMNS; a shape alone (5 values) stages nothing


def fit_step_cost(shapes: Sequence[Row], seconds: Sequence[float], relative: bool = True,
                  held: Sequence[str] = ()) -> tuple[StepCost, dict]:
    """The coefficients minimising the squared relative error (steps range from a millisecond to
    a second: each counts alike), or with `relative` False the squared error in seconds, with a term
    whose best value is negative held at 0 (and the others refitted), and the terms `held` at 0 from
    the start (a cost without them, to compare); the cost, and the residuals of each timed step."""
    fitted_terms = len(set(TERMS) - set(held))
    if len(shapes) != len(seconds) or len(shapes) < fitted_terms:
        raise ValueError(f"need as many timings as shapes, at least {fitted_terms}; "
                         f"got {len(shapes)} and {len(seconds)}")
    x = np.array([[1.0, *shape, *[0] * (len(COLUMNS) - len(shape))] for shape in shapes], dtype=float)
    y = np.asarray(seconds, dtype=float)
    coefficients, free = nonnegative_least_squares(x, y, relative,
                                                   [i for i, term in enumerate(TERMS) if term not in held])
    fitted = x @ coefficients
    errors = np.abs(y - fitted) / y
    fit = {"samples": len(y), "rms_residual_s": float(np.sqrt(np.mean((y - fitted) ** 2))),
           "mean_relative_error": float(errors.mean()), "max_relative_error": float(errors.max()),
           "held_at_zero": [TERMS[i] for i in range(len(TERMS)) if i not in free],
           "steps": [{**dict(zip(COLUMNS, shape)), "measured_s": float(m), "fitted_s": float(f)}
                     for shape, m, f in zip(shapes, y, fitted)]}
    return StepCost(*coefficients.tolist()), fit


def nonnegative_least_squares(x: np.ndarray, y: np.ndarray, relative: bool,
                              free: list[int]) -> tuple[np.ndarray, list[int]]:
    """The coefficients of x's columns `free` minimising the squared (relative) error of x @ them
    against y, the others 0, a column whose best value is negative held at 0 (and the others
    refitted); the coefficients, and the columns left free."""
    scale = y if relative else np.ones_like(y)
    free = list(free)
    while True:
        a = x[:, free] / scale[:, None]
        norms = np.linalg.norm(a, axis=0)  # columns to unit length: staged bytes run to 1e8 a step, the constant is 1
        norms[norms == 0] = 1.0            # a column of zeros (nothing staged) is fitted 0
        solved = np.linalg.lstsq(a / norms, y / scale, rcond=None)[0] / norms
        if (solved >= 0).all():
            break
        free.pop(int(np.argmin(solved)))
    coefficients = np.zeros(x.shape[1])
    coefficients[free] = solved
    return coefficients, free


def fit_engine_steps(steps: Sequence[dict], held: Sequence[str] = ()) -> tuple[StepCost, dict]:
    """The fit to steps as the engine service records them (`GET /v1/steps`: each its shape and the
    wall time of the loop's turn around it); the fit's summary, without its thousands of residuals.
    In seconds, not relative: in service one shape's time scatters (the CPU is shared), and a relative
    fit sits low in that scatter, under the steps' mean. The simulator adds steps up, so the fit must
    get their sum right: least squares with a constant term does, its residuals summing to zero.
    `held`: terms held at 0, as fit_step_cost's."""
    seconds = [s["seconds"] for s in steps]
    cost, fit = fit_step_cost([recorded_shape(s) for s in steps], seconds, relative=False, held=held)
    summary = {k: v for k, v in fit.items() if k != "steps"}
    return cost, {**summary, "measured_s": float(sum(seconds)), "fitted_s": sum(r["fitted_s"] for r in fit["steps"])}


def fit_copy_rate(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[CopyRate, dict]:
    """seconds = fixed_s + bytes / bytes_per_s through copies of `sizes` bytes timed `seconds`, least
    squares on the relative error (copies range from kilobytes to tens of megabytes), a negative
    fixed cost held at 0; the rate, and the residuals of each copy."""
    x = np.array([[1.0, size] for size in sizes], dtype=float)
    y = np.asarray(seconds, dtype=float)
    if len(y) != len(x) or len(set(sizes)) < 2:
        raise ValueError(f"need a timing of each copy, of two sizes at least; got {len(x)} copies, {len(y)} timings")
    (fixed, per_byte), _ = nonnegative_least_squares(x, y, True, [0, 1])
    if not per_byte > 0:
        raise ValueError("the copies took no longer the more they copied: no bandwidth to fit")
    fitted = x @ [fixed, per_byte]
    errors = np.abs(y - fitted) / y
    return CopyRate(float(1 / per_byte), float(fixed)), {
        "samples": len(y), "mean_relative_error": float(errors.mean()), "max_relative_error": float(errors.max()),
        "copies": [{"bytes": int(size), "measured_s": float(m), "fitted_s": float(f)}
                   for size, m, f in zip(sizes, y, fitted)]}


def recorded_shape(step: dict) -> Row:
    """A step's shape and staged bytes as `GET /v1/steps` lists them (0 staged in a record from before them)."""
    return (*(step[field] for field in FIELDS), step.get("staged_bytes", 0))


def describe(cost: StepCost, fit: dict, what: str) -> str:
    """The coefficients and how well they fit `fit['samples']` of `what`, for a person."""
    return (f"a = {cost.a * 1e3:.3f} ms/step, b = {cost.b * 1e6:.3f} us/prefill token, "
            f"c = {cost.c * 1e6:.3f} us/decode token, d = {cost.d * 1e9:.3f} ns/decode context token, "
            f"e = {cost.e * 1e9:.3f} ns/prefill (query, key) pair, f = {cost.f * 1e3:.3f} ms/prefill sequence, "
            f"g = {cost.g * 1e12:.3f} ps/staged byte\n"
            f"fit over {fit['samples']} {what}: mean relative error {fit['mean_relative_error']:.1%}, "
            f"max {fit['max_relative_error']:.1%}")
