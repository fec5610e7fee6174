"""The work a plain dense call does while it is traced, printed as a measure, not bounded.

``dot_product_attention(q, k, v, is_causal=True, normalizer="sigmoid")`` is lowered on the CPU
under ``sys.setprofile``, which sees every Python function attnjax enters. The test prints how
many functions and modules the call enters and how often a chain of calls returns into a
module it left (the op's callbacks do, by design: family -> op -> the family's engine), so a
change's cost shows in the log (``pytest -s``). The structural rule this once stood in for,
that imports only go down and never form a cycle, is ``tests/test_imports.py``'s.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import pytest

import attnjax

ROOT = os.path.dirname(os.path.abspath(attnjax.__file__))


def _module(frame) -> str | None:
  """The attnjax module (its file, relative to the package) a frame runs in, or None."""
  path = frame.f_code.co_filename
  return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else None


def _trace(fn, *args) -> tuple[list[tuple[str, str]], list[list[str]]]:
  """``(functions, chains)`` of lowering ``jax.jit(fn)(*args)`` from a fresh trace: each
  attnjax function entered (module, name) in order of first entry, and for every call into
  attnjax the chain of attnjax modules from the outermost frame to the function entered."""
  functions, chains = {}, []

  def profile(frame, event, arg):
    del arg
    if event != "call" or _module(frame) is None:
      return
    functions.setdefault((_module(frame), frame.f_code.co_name), None)
    chain, f = [], frame
    while f is not None:
      if _module(f) is not None:
        chain.append(_module(f))
      f = f.f_back
    chains.append(chain[::-1])

  jax.clear_caches()  # a trace cached by an earlier test would enter nothing
  lowering = jax.jit(fn)
  sys.setprofile(profile)
  try:
    lowering.lower(*args)
  finally:
    sys.setprofile(None)
  return list(functions), chains


# Calls the reference engine runs on a CPU: the plain call, and calls setting more.
CALLS = {
  "plain": dict(is_causal=True, normalizer="sigmoid"),
  "stats": dict(return_stats=True, normalizer="softpick"),
  "jax_nn": dict(local_window_size=3, softcap=5.0, return_residual=True),
}


def _trace_call(monkeypatch, keywords: dict):
  if jax.default_backend() != "cpu":
    pytest.skip("the count is of a CPU lowering (a GPU or TPU host asks its own kernels more)")
  monkeypatch.setattr(attnjax.config, "kernels", "checked")  # the default, whatever ran before
  q = jnp.ones((1, 64, 2, 16))
  return _trace(lambda q, k, v: attnjax.dot_product_attention(q, k, v, **keywords), q, q, q)


def returns_into_a_module(chain: list[str]) -> int:
  """How often a chain of calls (modules, outermost first) enters a module it has left:
  ``A -> B -> A`` counts one; ``A -> A -> B`` none."""
  runs = [m for i, m in enumerate(chain) if i == 0 or chain[i - 1] != m]
  return len(runs) - len(set(runs))


def test_returns_into_a_module():
  assert returns_into_a_module(["a", "a", "b"]) == 0
  assert returns_into_a_module(["a", "b", "a", "c", "b"]) == 2


@pytest.mark.parametrize("call", CALLS)
def test_the_work_of_a_call_is_printed(monkeypatch, call):
  functions, chains = _trace_call(monkeypatch, CALLS[call])
  names = [f"{module}:{name}" for module, name in functions]
  # Not vacuous: validation, dispatch and the engine's computation were all traced.
  assert {
    "_src/options.py:validate",
    "_src/op.py:run",
    "_src/ops/dense/reference.py:reference",
    "_src/normalizers.py:weights",
  } <= set(names), names
  modules = {module for module, _ in functions}
  returns = max((returns_into_a_module(c) for c in chains), default=0)
  print(
    f"\n{call}: {len(functions)} attnjax functions in {len(modules)} modules, "
    f"{len(chains)} calls; at most {returns} returns into a module along one chain"
  )
