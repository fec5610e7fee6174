"""One test base for every op's engines: each engine equals the op's readable reference.

A family's tests subclass :class:`OpTests`, name the op (``op``, a key of
:data:`attnjax._op.OPS`) and give its sample call (:meth:`OpTests.sample`: a function of the
engine's name and of the differentiable arguments, and those arguments).
``test_engine_matches_reference`` is then parametrised over the op's engines (by default
every engine that runs on every platform, and ``None``: auto-dispatch): the value and the
gradients with respect to every argument of each equal the reference's
(``implementation="reference"``) within a tolerance from the reduction length
(:func:`helpers.reduction_tolerance`), relative to each array's scale.

A family with normalisers also gives :meth:`OpTests.partial_block_sample`: a call whose
length is not a multiple of its block size (a partial last block, padded inside the engine),
held equal to the reference in value and gradient for every built-in normaliser
(``test_partial_last_block``: softpick's key gradients were all NaN there once).

``tests/engine_base.py``'s :class:`DenseEngineTests` is the dense case: one engine per
subclass, called on :func:`attnjax.dense.prepare`'s output, with its structures and options
on top.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import pytest

from attnjax._src import normalizers, op as _op
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

  def partial_block_sample(self, normalizer: str) -> Optional[tuple[Callable[..., Any], tuple]]:
    """``(fn, args)`` as :meth:`sample`, of a call with ``normalizer`` whose length is not a
    multiple of its block size; None: the family has no normalisers, or its calls take no
    block size (mla: the dense engines' own blocks, all of a short call)."""
    return None

  def pytest_generate_tests(self, metafunc):
    name = metafunc.function.__name__
    if name not in ("test_engine_matches_reference", "test_partial_last_block"):
      return
    engines = [
      pytest.param(e, id=str(e), marks=self.marks_of_sample()) for e in self.engine_names()
    ]
    if name == "test_engine_matches_reference":
      metafunc.parametrize("engine", engines)
      return
    if self.partial_block_sample("softmax") is None:
      metafunc.parametrize("engine,normalizer", [pytest.param(None, None, id="no-sample")])
      return
    metafunc.parametrize(
      "engine,normalizer",
      [
        pytest.param(e, n, id=f"{e}-{n}", marks=self.marks_of_sample())
        for e in self.engine_names()
        for n in normalizers.NORMALIZERS
      ],
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

  def test_partial_last_block(self, engine, normalizer):
    if normalizer is None:
      pytest.skip(f"{self.op} has no call with a partial last block (normalisers, block sizes)")
    fn, args = self.partial_block_sample(normalizer)
    if engine is not None:
      reasons = self.refusals(engine, normalizer)
      if reasons:
        pytest.skip(f"{engine} refuses normalizer={normalizer!r}: {reasons}")
    want = outputs_and_grads(lambda *a: fn("reference", *a), *args)
    got = outputs_and_grads(lambda *a: fn(engine, *a), *args)
    for leaf in jax.tree.leaves(got):
      assert bool(jnp.all(jnp.isfinite(leaf))), f"{self.op}[{engine}] {normalizer}: not finite"
    tol = self.sample_tolerance()
    assert_close(got, want, f"{self.op}[{engine}] {normalizer}", rtol=tol, atol=tol, scaled=True)

  def refusals(self, engine: str, normalizer: str) -> str:
    """Why ``engine`` refuses the partial-block call with ``normalizer`` ("" if it does not)."""
    del engine, normalizer
    return ""
