"""The work a plain dense call does while it is traced, held by counting the functions it enters.

``dot_product_attention(q, k, v, is_causal=True, normalizer="sigmoid")`` is lowered on the CPU
under ``sys.setprofile``, which sees every Python function attnjax enters (comprehensions and
generator expressions are functions too). A plain call must do only the work it needs:
validation skips the keywords left at None, and the choice per platform asks an engine only
what can change its answer. A change that makes such a call enter more functions than
:data:`MAX_FUNCTIONS` fails here; raise the bound only for work the call needs.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import pytest

import attnjax

ROOT = os.path.dirname(os.path.abspath(attnjax.__file__))
# Distinct attnjax functions the call enters (40: check_qkv calls the shared check_floating;
# 82 before the call path was trimmed).
MAX_FUNCTIONS = 40


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
  monkeypatch.setattr(attnjax.config, "auto_kernels", "checked")  # the default, whatever ran before
  q = jnp.ones((1, 64, 2, 16))
  return _trace(lambda q, k, v: attnjax.dot_product_attention(q, k, v, **keywords), q, q, q)


def test_a_plain_call_enters_few_functions(monkeypatch):
  functions, _ = _trace_call(monkeypatch, CALLS["plain"])
  names = [f"{module}:{name}" for module, name in functions]
  # Not vacuous: validation, dispatch and the engine's computation were all traced.
  assert {
    "_src/options.py:validate",
    "_src/op.py:choose",
    "_src/ops/dense/reference.py:reference",
    "_src/normalizers.py:weights",
  } <= set(names), names
  assert len(functions) <= MAX_FUNCTIONS, "\n".join(names)


@pytest.mark.parametrize("call", CALLS)
def test_a_call_never_returns_into_a_module_it_left(monkeypatch, call):
  """Along every chain of calls (the attnjax frames on the stack when a function is entered,
  outermost first, each named by its module's file), the modules form runs that never
  repeat: once a chain has left module A for another module, nothing further down that chain
  enters A again (A -> B -> A is a return into A; A -> A -> B is not). Returning from a call
  and calling another module next (A -> B, back in A, A -> C) is not a return into A."""
  functions, chains = _trace_call(monkeypatch, CALLS[call])
  assert ("_src/ops/dense/reference.py", "reference") in functions
  for chain in chains:
    runs = [m for i, m in enumerate(chain) if i == 0 or chain[i - 1] != m]
    assert len(runs) == len(set(runs)), " -> ".join(runs)
