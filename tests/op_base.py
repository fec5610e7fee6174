"""One test base for every op's engines: each engine equals the op's readable reference.

A family's tests subclass :class:`OpTests`, name the op (``op``, a key of
:data:`attnjax._op.OPS`) and give its sample call (:meth:`OpTests.sample`: a function of the
engine's name and of the differentiable arguments, and those arguments).
``test_engine_matches_reference`` is then parametrised over the op's engines (by default
every engine that runs on every platform, and ``None``: auto-dispatch): the value and the
gradients with respect to every argument of each equal the reference's
(``implementation="reference"``) within a tolerance from the reduction length
(:func:`helpers.reduction_tolerance`), relative to each array's scale.

``tests/engine_base.py``'s :class:`DenseEngineTests` is the dense case: one engine per
subclass, called on :func:`attnjax.dense.prepare`'s output, with its structures and options
on top.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax.numpy as jnp
import pytest

from attnjax._src import op as _op
from helpers import assert_close, outputs_and_grads, reduction_tolerance


class OpTests:
  """Subclass as ``TestMyFamily(OpTests)``; set ``op`` and override :meth:`sample`."""

  op: str = ""
  # None: every engine of the op that runs on every platform (but the reference), and None
  engines: Optional[tuple[Optional[str], ...]] = None
  # the longest reduction of the sample call and how many reductions run in sequence
  # (values and gradients): the tolerance is reduction_tolerance(float32, length, depth)
  length: int = 64
  depth: int = 8
  supports_grad: bool = True  # False: values only
  # marks of every case (a base whose other tests already cover the sample: slow)
  sample_marks: tuple = ()

  def sample(self) -> tuple[Callable[..., Any], tuple]:
    """``(fn, args)``: ``fn(implementation, *args)`` calls the op's engine
    ``implementation`` (or the reference, or auto-dispatch for None) on ``args``, the
    differentiable arguments (float32)."""
    raise NotImplementedError

  def sample_tolerance(self) -> float:
    """The tolerance of each array, relative to its scale (its largest entry, at least 1)."""
    return reduction_tolerance(jnp.float32, self.length, depth=self.depth)

  def op_record(self) -> _op.Op:
    """The op whose engines are tested (read when the tests are collected)."""
    return _op.OPS[self.op]

  def engine_names(self) -> tuple[Optional[str], ...]:
    if self.engines is not None:
      return self.engines
    op = self.op_record()
    return tuple(n for n, e in op.engines.items() if n != "reference" and e.platform is None) + (
      None,
    )

  def pytest_generate_tests(self, metafunc):
    if metafunc.function.__name__ != "test_engine_matches_reference":
      return
    metafunc.parametrize(
      "engine",
      [pytest.param(e, id=str(e), marks=self.marks_of_sample()) for e in self.engine_names()],
    )

  def marks_of_sample(self) -> list:
    return list(self.sample_marks)

  def test_engine_matches_reference(self, engine):
    fn, args = self.sample()
    assert engine is None or engine in _op.OPS[self.op].engines, (self.op, engine)
    if self.supports_grad:
      want = outputs_and_grads(lambda *a: fn("reference", *a), *args)
      got = outputs_and_grads(lambda *a: fn(engine, *a), *args)
    else:
      want, got = fn("reference", *args), fn(engine, *args)
    tol = self.sample_tolerance()
    assert_close(got, want, f"{self.op}[{engine}]", rtol=tol, atol=tol, scaled=True)
