"""Gated linear attention: a linear-attention state that decays, per head or per key channel.

Per query head the state ``S_t`` (``[H, Hv]``, float32) follows

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T          o_t = scale * S_t^T q_t

with ``g_t = log_decay_t <= 0``. A decay that is one scalar per head covers
RetNet (a constant per head, Sun et al. 2023) and Mamba-2 / SSD (a
data-dependent scalar, Dao & Gu 2024); a decay per key channel ``[H]`` is GLA
(Yang et al. 2024). Unrolled,

    o_i = scale * sum_{j <= i} (q_i * exp(c_i - c_j))^T k_j v_j
          + scale * (q_i * exp(c_i))^T S_0,           c_i = sum_{t <= i} g_t,

so every decay factor is ``exp`` of a difference of cumulative sums that is
``<= 0``: it never overflows, however strong the gate.

Three forms (``implementation``, the names of every recurrent family, see
``attnjax._recurrent``) compute the same function and are tested equal in
value, final state and every gradient:

- ``recurrent``: the recurrence as a ``lax.scan`` over time; the decode form.
  It is the readable definition, so ``"reference"`` names it
  (:data:`~attnjax.gated_linear.REFERENCE_FORM`).
- ``quadratic`` (formerly ``parallel``, which still works and warns once): the
  masked quadratic form above over the whole sequence,
  materialising the ``[T, T]`` (scalar decay) or ``[T, T, H]`` (per-channel)
  decay matrix; for short sequences and tests.
- ``chunked`` (default): O(T). Inside a chunk of ``chunk_size`` the quadratic
  form with decays relative to the chunk's start (cumulative sums restart at
  every chunk, so the exponents stay ``<= 0`` and bounded by one chunk);
  across chunks a ``lax.scan`` carries the state, decayed by the chunk's total.
  Per-channel decays run ``attnjax.kernels.recurrent.gla_chunk.gla_chunk`` on each chunk:
  secondary chunking (``[SUB_BLOCK, SUB_BLOCK, H]`` decays inside a sub-block,
  one matmul through a reference token for earlier sub-blocks, never an
  ``exp`` of a positive number) and a hand-written backward, whose decay
  gradient is a sum identity instead of autodiff through every ``exp``.

``segment_ids`` ``[B, T]`` reset the state where the id changes from one
token to the next (packed documents): a token of a new segment sees no earlier
key and none of the initial state. The first token of a call never resets, so
``initial_state`` always continues into it (chaining calls equals one call).

Gradients flow to ``q``, ``k``, ``v``, ``log_decay`` and ``initial_state``.
The chunked form keeps for its backward the chunks' inputs and the state
entering each chunk (``T / chunk_size`` states of ``[H, Hv]`` per head) and
recomputes each chunk, so training memory is O(T), about 1.7 inputs' worth
(``tests/test_chunks.py``); the
recurrent and quadratic forms are differentiated by plain autodiff, which keeps
a state per token (O(T H Hv)). Exponents that are exactly 0
(a token's decay to itself, the last key's decay to the chunk's end) are set,
not computed as differences, so the decays' gradient stays accurate on its own
scale (~1e-8 under ``log_decay = -20``) instead of drowning in float32
cancellation of O(1) terms.

What :func:`.gated_linear_attention` returns follows :mod:`attnjax.linear`:
``out``, or ``(out, state)`` with ``return_state=True``.
"""

from attnjax._src.ops.gated_linear.attention import IMPLEMENTATIONS
from attnjax._src.ops.gated_linear.attention import (GATED_LINEAR_STATIC, OP, REFERENCE_FORM,
                                                     SUB_BLOCK, chunked, gated_linear_attention,
                                                     parallel, quadratic, recurrent)

__all__ = ["GATED_LINEAR_STATIC", "IMPLEMENTATIONS", "OP", "REFERENCE_FORM", "SUB_BLOCK",
    "chunked", "gated_linear_attention", "parallel", "quadratic", "recurrent"]
