"""Fast paths against their references, with and without ``jax.jit`` (``chex.variants``).

Each fast path is the Python function behind the library's jitted entry point,
so ``without_jit`` runs it eagerly on concrete arrays (document ids, decays and
states as values: the host-side branches) and ``with_jit`` traces it inside an
outer jit (the traced branches). Outputs, final states and every gradient are
compared in one :func:`helpers.assert_close` call. Small shapes, but the eager
variant compiles each operation once: a few cases, all in ``-m slow`` (the default suite is
at its time budget).
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnjax._src.ops.dense import attention as dense
from attnjax._src.ops.gated_linear import attention as gated_linear
from attnjax._src.ops.linear import attention as linear
from attnjax._src import mods
from helpers import assert_close, rand_qkv


def _value_and_grads(attend, argnums):
  """``run(*args) -> (attend's outputs, gradients wrt args[argnums])`` of a loss on every output."""

  def run(*args):
    def loss(*args):
      out = attend(*args)
      return sum(jnp.sum(jnp.sin(x.astype(jnp.float32))) for x in jax.tree.leaves(out)), out

    (_, out), grads = jax.value_and_grad(loss, argnums=argnums, has_aux=True)(*args)
    return out, grads

  return run


@pytest.mark.slow  # ~25 s of compiles (eager runs included): kept out of the default run
class FastPathsMatchReferences(chex.TestCase):
  def _name(self) -> str:
    return self.variant.type.name.lower()  # with_jit / without_jit

  @chex.variants(with_jit=True, without_jit=True)
  def test_blockwise_with_document_mask_mod(self):
    # Concrete ids build the block layout on the host; traced ids classify blocks at run time.
    B, T = 2, 12
    q, k, v = rand_qkv(B, T, T, 4, 2, 8)
    ids = jnp.asarray(np.stack([np.arange(T) // 5, np.arange(T) // 8]), jnp.int32)

    def blockwise(q, k, v, ids):
      return dense._dot_product_attention(
        q,
        k,
        v,
        is_causal=True,
        implementation="blockwise",
        mask_mod=mods.document_mask,
        mask_mod_args=(ids,),
      )

    def reference(q, k, v, ids):
      return dense.dot_product_attention(
        q, k, v, is_causal=True, segment_ids=ids, implementation="reference"
      )

    got = self.variant(_value_and_grads(blockwise, (0, 1, 2)))(q, k, v, ids)
    want = jax.jit(_value_and_grads(reference, (0, 1, 2)))(q, k, v, ids)
    assert_close(
      got, want, f"{self._name()}: blockwise output and grads (q, k, v)", rtol=1e-5, atol=1e-5
    )

  @chex.variants(with_jit=True, without_jit=True)
  def test_linear_chunked_with_a_state(self):
    B, T, K, H = 1, 11, 2, 4  # T is not a multiple of chunk_size
    q, k, v = rand_qkv(B, T, T, 4, K, H, seed=1)
    rng = np.random.default_rng(2)
    state = linear.LinearState(
      jnp.asarray(rng.uniform(0, 1, (B, K, H, H)), jnp.float32),
      jnp.asarray(rng.uniform(1, 2, (B, K, H)), jnp.float32),
    )
    form = lambda implementation: functools.partial(
      linear._linear_attention,
      is_causal=True,
      implementation=implementation,
      chunk_size=4,
      return_state=True,
    )
    got = self.variant(
      _value_and_grads(lambda q, k, v, s: form("chunked")(q, k, v, initial_state=s), (0, 1, 2, 3))
    )(q, k, v, state)
    want = jax.jit(
      _value_and_grads(lambda q, k, v, s: form("reference")(q, k, v, initial_state=s), (0, 1, 2, 3))
    )(q, k, v, state)
    assert_close(
      got, want, f"{self._name()}: chunked linear output, state and grads", rtol=1e-4, atol=1e-4
    )

  @chex.variants(with_jit=True, without_jit=True)
  @pytest.mark.slow  # ~8 s of compiles; tests/test_gated_linear.py checks the forms under jit
  def test_gated_linear_chunked_with_segments(self):
    B, T, N, H = 1, 11, 2, 4
    q, k, v = rand_qkv(B, T, T, N, N, H, seed=3)
    rng = np.random.default_rng(4)
    g = jnp.asarray(-rng.uniform(0.05, 1.0, (B, T, N)), jnp.float32)
    s0 = jnp.asarray(rng.standard_normal((B, N, H, H)), jnp.float32)
    seg = jnp.asarray((np.arange(T) >= 6)[None], jnp.int32)

    def form(implementation):
      def attend(q, k, v, g, s0, seg):
        return gated_linear._gated_linear_attention(
          q,
          k,
          v,
          log_decay=g,
          initial_state=s0,
          segment_ids=seg,
          return_state=True,
          implementation=implementation,
          chunk_size=4,
        )

      return attend

    got = self.variant(_value_and_grads(form("chunked"), (0, 1, 2, 3, 4)))(q, k, v, g, s0, seg)
    want = jax.jit(_value_and_grads(form("reference"), (0, 1, 2, 3, 4)))(q, k, v, g, s0, seg)
    assert_close(
      got,
      want,
      f"{self._name()}: chunked GLA output, state and grads (q, k, v, log_decay, initial_state)",
      rtol=2e-5,
      atol=2e-5,
    )
