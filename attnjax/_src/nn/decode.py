"""Decoding helpers: ``init_cache``, ``decode_step`` and ``generate``.

The cache is a pytree (one entry per layer) threaded through pure calls:

>>> import jax
>>> from flax import nnx
>>> from attnjax import nn
>>> model = nn.TransformerLM(nn.ModelConfig(vocab_size=64, num_layers=2), rngs=nnx.Rngs(0))
>>> cache = nn.init_cache(model, batch_size=2, max_len=16)
>>> logits, cache = nn.decode_step(model, jax.numpy.zeros((2, 4), int), cache)   # prefill
>>> logits.shape
(2, 4, 64)
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from attnjax._src.nn.transformer import TransformerLM

Array = jnp.ndarray


def init_cache(model: TransformerLM, batch_size: int, max_len: int) -> list:
  """Empty per-layer caches for ``batch_size`` sequences of up to ``max_len`` tokens.

  Args:
    model: a :class:`.TransformerLM`.
    batch_size: ``B``.
    max_len: the longest sequence to decode (prompt included).

  Returns:
    A list with each layer's cache (its family's, and its ``cache_policy``'s).
  """
  return model.init_cache(batch_size, max_len)


@nnx.jit
def decode_step(
  model: TransformerLM,
  tokens: Array,
  cache: list,
  segment_ids: Optional[Array] = None,
  positions: Optional[Array] = None,
):
  """The logits of the next ``tokens`` given the cache, and the advanced cache (jitted).

  A prompt goes in at once (prefill), later tokens one at a time; prefill then steps
  equal the full forward.

  Args:
    model: a :class:`.TransformerLM`.
    tokens: integer ``[B, T]``, the tokens after those the cache holds.
    cache: the list :func:`.init_cache` made, as the last step returned it.
    segment_ids: ``[B, T]`` segment ids of the new tokens (packed decoding), or None.
    positions: ``[B, T]`` positions of the new tokens (packed decoding), or None.

  Returns:
    ``(logits [B, T, V] float32, cache)``.
  """
  return model.decode(tokens, cache, segment_ids=segment_ids, positions=positions)


def _sample(logits: Array, key: Array, temperature: float, top_k: Optional[int]) -> Array:
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / temperature
  if top_k is not None:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generate(
  model: TransformerLM,
  prompt: Array,
  num_tokens: int,
  *,
  rng: Optional[Array] = None,
  temperature: float = 0.0,
  top_k: Optional[int] = None,
  max_len: Optional[int] = None,
) -> Array:
  """Continues ``prompt`` ``[B, T0]`` by ``num_tokens`` tokens.

  Args:
    model: a :class:`.TransformerLM`.
    prompt: ``[B, T0]`` integer tokens, ``T0 >= 1``.
    num_tokens: tokens to generate.
    rng: PRNG key for sampling (needed when ``temperature > 0``).
    temperature: 0 = greedy (argmax); otherwise sample from ``softmax(logits / t)``.
    top_k: sample only among the ``top_k`` most likely tokens.
    max_len: cache length (default ``T0 + num_tokens``).

  Returns:
    ``[B, T0 + num_tokens]`` int32: the prompt followed by the generated tokens.

  Raises:
    ValueError: a prompt that is not ``[B, T0]`` with ``T0 >= 1``, a negative
      ``num_tokens`` or ``temperature``, or ``temperature > 0`` without ``rng``.
  """
  prompt = jnp.asarray(prompt, jnp.int32)
  if prompt.ndim != 2 or prompt.shape[1] < 1:
    raise ValueError(f"prompt must be [B, T0] with T0 >= 1, got shape {prompt.shape}")
  if num_tokens < 0:
    raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if temperature > 0 and rng is None:
    raise ValueError("temperature > 0 needs rng (a jax.random key)")
  if num_tokens == 0:
    return prompt
  B, T0 = prompt.shape
  max_len = T0 + num_tokens if max_len is None else max_len
  rng = jax.random.key(0) if rng is None else rng
  graphdef, state = nnx.split(model)
  cache = model.init_cache(B, max_len)
  return _generate(
    graphdef,
    state,
    prompt,
    cache,
    rng,
    num_tokens=num_tokens,
    temperature=float(temperature),
    top_k=top_k,
  )


@functools.partial(jax.jit, static_argnames=("graphdef", "num_tokens", "temperature", "top_k"))
def _generate(graphdef, state, prompt, cache, rng, *, num_tokens, temperature, top_k):
  model = nnx.merge(graphdef, state)
  keys = jax.random.split(rng, num_tokens)
  logits, cache = model.decode(prompt, cache)
  first = _sample(logits[:, -1], keys[0], temperature, top_k)

  def step(carry, key):
    token, cache = carry
    logits, cache = model.decode(token[:, None], cache)
    return (_sample(logits[:, -1], key, temperature, top_k), cache), token

  (last, _), tokens = jax.lax.scan(step, (first, cache), keys[1:])
  generated = jnp.concatenate([jnp.transpose(tokens), last[:, None]], axis=1)
  return jnp.concatenate([prompt, generated], axis=1)
