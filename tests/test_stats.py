"""attnjax.stats: every metric on hand-built inputs with closed-form answers, plus edges."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax._src import normalizers
from attnjax import stats
from attnjax._src.train import metrics as run_metrics
from helpers import rand_qkv


def harmonic(n):
  return sum(1.0 / i for i in range(1, n + 1))


def uniform_causal(T):
  """A_ij = 1 / (i + 1) for j <= i (0-indexed): every query spreads evenly over what it sees."""
  i = np.arange(T)[:, None]
  j = np.arange(T)[None, :]
  return np.where(j <= i, 1.0 / (i + 1), 0.0).astype(np.float32)


def sink_head(T, first=0.5):
  """Row 0 puts 1 on key 0; each later row puts `first` on key 0 and spreads the rest over 1..i."""
  w = np.zeros((T, T), np.float32)
  w[0, 0] = 1.0
  for i in range(1, T):
    w[i, 0] = first
    w[i, 1 : i + 1] = (1.0 - first) / i
  return w


def heads(*mats):
  """[B=1, N, T, T] from per-head matrices."""
  return jnp.asarray(np.stack(mats)[None])


def causal_logits(key, B, N, T):
  z = jax.random.normal(key, (B, N, T, T)) * 2.0
  return z


def random_qkv(seed, B=2, T=12, N=4, K=2, H=8):
  return rand_qkv(B=B, T=T, N=N, K=K, H=H, seed=seed)


# ---------------------------------------------------------------------------
# Importance alpha_k and sink rate (Gu et al.).


@pytest.mark.parametrize("T", [1, 5, 64], ids=lambda t: f"T{t}")
def test_importance_of_uniform_causal_is_harmonic(T):
  alpha = np.asarray(stats.importance(jnp.asarray(uniform_causal(T))))
  for k in range(1, T + 1):  # paper's 1-indexed k = array index k - 1
    expected = (harmonic(T) - harmonic(k - 1)) / (T - k + 1)
    np.testing.assert_allclose(alpha[k - 1], expected, rtol=1e-5)


def test_sink_rate_three_of_eight_heads():
  T = 64
  w = heads(*([sink_head(T)] * 3 + [uniform_causal(T)] * 5))
  result = stats.sink_rate(w)
  assert float(result.rate) == pytest.approx(37.5)
  np.testing.assert_allclose(result.per_layer, [37.5])
  alpha = np.asarray(result.importance)[0, 0]
  np.testing.assert_allclose(alpha[:3], (1 + (T - 1) * 0.5) / T, rtol=1e-5)
  np.testing.assert_allclose(alpha[3:], harmonic(T) / T, rtol=1e-5)
  np.testing.assert_allclose(result.row_sum, [1.0], rtol=1e-6)


def test_sink_rate_per_layer_and_batch_average():
  T = 16
  layer0 = heads(*([sink_head(T)] * 3 + [uniform_causal(T)] * 5))
  layer1 = heads(*([sink_head(T)] * 1 + [uniform_causal(T)] * 7))
  result = stats.sink_rate([layer0, layer1])
  np.testing.assert_allclose(result.per_layer, [37.5, 12.5])
  assert float(result.rate) == pytest.approx(25.0)
  # Batch of two sequences, a head that is a sink in one of them: counted per sequence (Gu's code).
  two = jnp.concatenate(
    [heads(sink_head(T), uniform_causal(T)), heads(uniform_causal(T), uniform_causal(T))], axis=0
  )
  assert float(stats.sink_rate(two).rate) == pytest.approx(25.0)


def test_sink_rate_k_is_one_indexed():
  T = 8
  w = np.zeros((T, T), np.float32)
  w[np.arange(T), np.minimum(np.arange(T), 1)] = 1.0  # every query i >= 1 puts all on key 2
  result = stats.sink_rate(heads(w), k=2)
  np.testing.assert_allclose(result.importance, [[[1.0]]])
  assert float(stats.sink_rate(heads(w), k=1).rate) == 0.0  # alpha_1 = 1/T


def test_sink_rate_on_unnormalised_rows():
  """Rows summing to 0.4 with 0.2 on key 1: a sink after row normalisation, not before."""
  T = 32
  w = sink_head(T) * 0.4
  result = stats.sink_rate(heads(w, uniform_causal(T) * 0.4))
  np.testing.assert_allclose(result.importance[0, 0, 0], (1 + (T - 1) * 0.5) / T, rtol=1e-5)
  assert float(result.rate) == pytest.approx(50.0)
  np.testing.assert_allclose(result.row_sum, [0.4], rtol=1e-5)
  raw = stats.sink_rate(heads(w, uniform_causal(T) * 0.4), row_normalize=False)
  assert float(raw.rate) == 0.0
  np.testing.assert_allclose(raw.row_sum, [0.4], rtol=1e-5)


def test_sink_rate_with_appended_bias_slot():
  """S = T + 1 (attnjax.nn kv_bias): the slot shares each row's mass but gets no alpha."""
  T = 8
  w = np.concatenate([sink_head(T) * 0.5, np.full((T, 1), 0.5, np.float32)], axis=1)
  result = stats.sink_rate(heads(w))
  np.testing.assert_allclose(result.importance, [[[(0.5 + (T - 1) * 0.25) / T]]], rtol=1e-6)
  np.testing.assert_allclose(result.row_sum, [1.0], rtol=1e-6)
  assert stats.importance(heads(w)).shape == (1, 1, T)
  with pytest.raises(ValueError, match="exceeds"):
    stats.sink_rate(heads(w), k=T + 1)


@pytest.mark.parametrize("normalizer", ["softmax", "softmax_one", "sigmoid"])
def test_sink_rate_and_f_attn_from_stats_match_weights(normalizer):
  q, k, v = random_qkv(0)
  q = q * 3.0  # sharper rows so some heads cross eps
  B, T, N, H = q.shape
  K = k.shape[2]
  _, st = attnjax.dot_product_attention(
    q, k, v, is_causal=True, normalizer=normalizer, return_stats=True
  )
  z = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, N // K, axis=2)) * H**-0.5
  w, _ = normalizers.normalize(z, attnjax.masks.causal_mask(T, T), normalizer=normalizer)
  from_w = stats.sink_rate(w, eps=0.1)
  from_s = stats.sink_rate(st, eps=0.1)
  np.testing.assert_allclose(from_s.importance, from_w.importance, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(from_s.rate, from_w.rate)
  np.testing.assert_allclose(from_s.row_sum, from_w.row_sum, rtol=1e-5)
  np.testing.assert_allclose(
    stats.first_token_attention(st).per_head, stats.first_token_attention(w).per_head, rtol=1e-5
  )
  np.testing.assert_allclose(
    stats.attention_entropy(st).per_head, stats.attention_entropy(w).per_head, rtol=1e-5
  )


def test_stats_layer_forms_agree():
  q, k, v = random_qkv(1)
  _, s0 = attnjax.dot_product_attention(q, k, v, is_causal=True, return_stats=True)
  _, s1 = attnjax.dot_product_attention(q * 2, k, v, is_causal=True, return_stats=True)
  stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), s0, s1)
  a = stats.first_token_attention([s0, s1])
  b = stats.first_token_attention(stacked)
  np.testing.assert_allclose(a.per_head, b.per_head)
  assert a.per_head.shape == (2, q.shape[2])


# ---------------------------------------------------------------------------
# F-Attn, entropy, max logit, null mass, gates, sparsity.


def test_first_token_attention_closed_form():
  T = 10
  result = stats.first_token_attention(heads(sink_head(T), uniform_causal(T)))
  uniform = (harmonic(T) - 1.0) / (T - 1)  # mean over i = 2..T of 1/i
  np.testing.assert_allclose(result.per_head, [[0.5, uniform]], rtol=1e-5)
  assert float(result.f_attn) == pytest.approx((0.5 + uniform) / 2, rel=1e-5)


def test_entropy_closed_form():
  T = 6
  one_hot = np.zeros((T, T), np.float32)
  one_hot[:, 0] = 1.0
  result = stats.attention_entropy(heads(uniform_causal(T), one_hot))
  uniform = sum(math.log(i) for i in range(1, T + 1)) / T
  np.testing.assert_allclose(result.per_head, [[uniform, 0.0]], atol=1e-6)
  np.testing.assert_allclose(result.mean, [uniform / 2], rtol=1e-5)
  np.testing.assert_allclose(result.min, [0.0], atol=1e-6)


def test_max_logit_ignores_masked_pairs():
  z = np.zeros((1, 2, 4, 4), np.float32)
  z[0, 1, 2, 1] = 5.0  # allowed (j <= i)
  z[0, 0, 1, 3] = 50.0  # future key: masked under causal
  np.testing.assert_allclose(stats.max_attention_logit(jnp.asarray(z)), [5.0])
  np.testing.assert_allclose(stats.max_attention_logit(jnp.asarray(z), is_causal=False), [50.0])
  q, k, v = random_qkv(2)
  _, st = attnjax.dot_product_attention(q, k, v, is_causal=True, return_stats=True)
  np.testing.assert_allclose(stats.max_attention_logit(st), [float(jnp.max(st.max_logit))])


def test_null_mass_closed_form_and_from_stats():
  B, T, N, H = 1, 6, 2, 4
  q = jnp.zeros((B, T, N, H))
  k = jnp.ones((B, T, N, H))
  sink = jnp.array([0.0, 1.5])
  _, st = attnjax.dot_product_attention(
    q, k, k, is_causal=True, sink_logits=sink, return_stats=True
  )
  expected = [np.mean([math.exp(s) / (math.exp(s) + i + 1) for i in range(T)]) for s in (0.0, 1.5)]
  from_stats = stats.null_mass(st)
  from_logits = stats.null_mass(jnp.zeros((B, N, T, T)), sink)
  np.testing.assert_allclose(from_stats.per_head, [expected], rtol=1e-5)
  np.testing.assert_allclose(from_logits.per_head, [expected], rtol=1e-5)
  np.testing.assert_allclose(from_logits.mean, np.mean(expected), rtol=1e-5)


def test_gate_mass():
  gates = jnp.full((2, 3, 4, 2, 1), 0.25)  # [L, B, T, N, 1] headwise
  result = stats.gate_mass(gates)
  np.testing.assert_allclose(result.per_layer, [0.25, 0.25])
  np.testing.assert_allclose(stats.gate_mass(jnp.zeros((3, 4, 2, 8)), from_logits=True).mean, 0.5)


def test_attention_sparsity_h2o_threshold():
  w = np.array([[[[0.9, 0.005, 0.095, 0.0], [0.25, 0.25, 0.25, 0.25]]]], np.float32)  # [1, 1, 2, 4]
  result = stats.attention_sparsity(jnp.asarray(w), is_causal=False)
  assert float(result.mean) == pytest.approx(2 / 8)
  # Causal 4x4: masked zeros do not count as sparse.
  assert float(stats.attention_sparsity(heads(uniform_causal(4))).mean) == 0.0
  one_hot = np.eye(4, dtype=np.float32)  # row i: 1 on key i, 0 on the i earlier keys
  assert float(stats.attention_sparsity(heads(one_hot)).mean) == pytest.approx(6 / 10)


# ---------------------------------------------------------------------------
# q/k geometry.


def test_qk_statistics_closed_form():
  B, T, N, H = 1, 4, 1, 4
  e1, e2 = np.eye(H, dtype=np.float32)[:2]
  q = jnp.asarray(np.tile(3 * e1, (B, T, N, 1)))
  k = jnp.asarray(np.stack([2 * e1, e2, 2 * e1, e2])[None, :, None, :])
  result = stats.qk_statistics(q, k)
  np.testing.assert_allclose(result.q_rms, [3 / math.sqrt(H)], rtol=1e-6)
  np.testing.assert_allclose(result.k_rms, [math.sqrt((4 + 1) / 2 / H)], rtol=1e-6)
  np.testing.assert_allclose(result.mean_cos, [6 / 10], rtol=1e-6)  # 10 causal pairs, 6 with e1
  np.testing.assert_allclose(result.max_logit, [6 * H**-0.5], rtol=1e-6)


def test_sink_geometry_closed_form():
  B, T, K, H = 2, 5, 1, 3
  e1, e2 = np.eye(H, dtype=np.float32)[:2]
  k = np.tile(e2, (B, T, K, 1))
  k[:, 0] = 2 * e1
  v = np.tile(e2, (B, T, K, 1))
  v[:, 0] = 0.5 * e2
  q = np.tile(e1 + 0.0 * e2, (B, T, 2, 1))  # N=2 query heads share one kv head
  result = stats.sink_geometry(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
  np.testing.assert_allclose(result.key_norm_ratio, [2.0], rtol=1e-6)
  np.testing.assert_allclose(result.value_norm_ratio, [0.5], rtol=1e-6)
  np.testing.assert_allclose(result.cos_first_key, [1.0], rtol=1e-6)
  np.testing.assert_allclose(result.cos_other_keys, [0.0], atol=1e-7)


# ---------------------------------------------------------------------------
# Hidden states.


def test_massive_activations_need_both_conditions():
  h = np.full((2, 2, 8, 16), 0.05, np.float32)  # [L, B, T, D]; median 0.05 -> 1000x = 50
  h[0, 0, 3, 5] = 500.0  # massive
  h[0, 0, 4, 1] = -150.0  # massive (by magnitude)
  h[0, 0, 5, 2] = 80.0  # > 1000x median but not > 100
  h[1, 1] = 1.0  # median 1 -> 1000x = 1000
  h[1, 1, 0, 0] = 500.0  # > 100 but not 1000x the median of its own hidden state
  result = stats.massive_activations(jnp.asarray(h))
  np.testing.assert_array_equal(result.count, [2, 0])
  np.testing.assert_allclose(result.max_abs, [500.0, 500.0])
  np.testing.assert_allclose(result.median_abs, [[0.05, 0.05], [0.05, 1.0]], rtol=1e-6)
  assert float(result.m_act) == 500.0


def test_kurtosis_closed_form():
  h = np.zeros((1, 3, 8), np.float32)  # [B, T, D], one layer
  h[0, 0] = [1, -1] * 4  # kurtosis 1
  h[0, 1] = [2, 0, 0, 0, 0, 0, 0, -2]  # var 1, m4 4 -> 4
  h[0, 2] = 7.0  # zero variance: left out
  result = stats.kurtosis(jnp.asarray(h))
  np.testing.assert_allclose(result.per_layer, [2.5], rtol=1e-6)


# ---------------------------------------------------------------------------
# Output logits and kernel approximation.


def test_output_logit_drift():
  V = 7
  logits = jnp.zeros((2, 3, V))
  result = stats.output_logit_drift(logits)
  assert float(result.mean_log_z) == pytest.approx(math.log(V), rel=1e-6)
  assert float(result.z_loss) == pytest.approx(1e-4 * math.log(V) ** 2, rel=1e-5)
  shifted = logits.at[0].add(-3.0)
  mask = jnp.array([[True] * 3, [False] * 3])
  assert float(stats.output_logit_drift(shifted, mask=mask).mean_log_z) == pytest.approx(
    math.log(V) - 3.0, rel=1e-6
  )


def test_kernel_approximation_error_closed_form():
  a = jnp.asarray(uniform_causal(5))[None]
  np.testing.assert_allclose(stats.kernel_approximation_error(a * 1.25, a), [0.25], rtol=1e-6)
  np.testing.assert_allclose(stats.kernel_approximation_error(a, a), [0.0])
  zero = jnp.zeros((1, 5, 5))
  np.testing.assert_array_equal(stats.kernel_approximation_error(a, zero), [np.inf])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PositiveRandomFeatures:
  """FAVOR+ (Choromanski et al.) as a pytree callable, the shape of attnjax.feature_maps maps."""

  projection: jax.Array  # [m, H], traced

  def __call__(self, x, *, is_query):
    del is_query  # unstabilised: queries and keys are mapped alike
    m, H = self.projection.shape
    x = x * H**-0.25
    return jnp.exp(x @ self.projection.T - jnp.sum(x * x, -1, keepdims=True) / 2) / math.sqrt(m)


def test_feature_map_error_exact_and_favor():
  q, k, _ = random_qkv(3, B=1, T=16, N=2, K=1, H=8)
  # Keys at zero make softmax uniform over the allowed keys; a constant feature map does too.
  const = lambda x: jnp.ones(x.shape[:-1] + (3,), x.dtype)
  np.testing.assert_allclose(
    stats.feature_map_attention_error(q, jnp.zeros_like(k), feature_map=const),
    np.zeros((1, 2)),
    atol=1e-6,
  )
  favor = lambda m: PositiveRandomFeatures(jax.random.normal(jax.random.key(7), (m, 8)))
  small = stats.feature_map_attention_error(q * 0.5, k * 0.5, feature_map=favor(4))
  large = stats.feature_map_attention_error(q * 0.5, k * 0.5, feature_map=favor(2048))
  assert float(jnp.max(large)) < 0.1 < float(jnp.mean(small))
  # The same map as a plain (static) function gives the same numbers.
  as_function = lambda x: favor(4)(x, is_query=True)
  np.testing.assert_allclose(
    stats.feature_map_attention_error(q * 0.5, k * 0.5, feature_map=as_function), small, rtol=1e-5
  )


# ---------------------------------------------------------------------------
# Run level.


LRS = [1e-3, 1e-2, 1e-1, 1.0]


def test_lr_sensitivity_with_one_diverged_lr():
  assert run_metrics.lr_sensitivity(LRS, [3.0, 2.0, 2.5, float("nan")], 4.0) == pytest.approx(
    (1.0 + 0.0 + 0.5 + 2.0) / 4
  )
  assert run_metrics.lr_sensitivity(LRS, [3.0, 2.0, float("inf"), 5.0], 4.0) == pytest.approx(
    (1.0 + 0.0 + 2.0 + 2.0) / 4
  )  # Inf diverged; 5 > loss_0 clipped to loss_0


def test_lr_sensitivity_edges():
  assert run_metrics.lr_sensitivity(LRS, [float("nan")] * 4, 4.0) == 0.0
  assert run_metrics.lr_sensitivity(LRS, [4.5, 5.0, 6.0, 4.2], 4.0) == 0.0  # never learns
  assert run_metrics.lr_sensitivity(LRS, [2.0] * 4, [4.0, 4.1, 3.9, 4.0]) == 0.0
  with pytest.raises(ValueError, match="final_losses"):
    run_metrics.lr_sensitivity(LRS, [1.0, 2.0], 4.0)
  with pytest.raises(ValueError, match="learning_rates is empty"):
    run_metrics.lr_sensitivity([], [], 4.0)
  with pytest.raises(ValueError, match="initial_loss must be finite"):
    run_metrics.lr_sensitivity(LRS, [1.0] * 4, float("nan"))
  with pytest.raises(ValueError, match="positive"):
    run_metrics.lr_sensitivity([0.0, 1.0], [1.0, 1.0], 4.0)


def test_max_stable_lr():
  assert run_metrics.max_stable_lr(LRS, [3.0, 2.0, 2.5, float("nan")], 4.0) == 0.1
  assert run_metrics.max_stable_lr(LRS, [3.0, 2.0, 4.5, float("nan")], 4.0) == 0.01
  assert (
    run_metrics.max_stable_lr(LRS, [3.0, 2.0, 2.5, 3.0], 4.0, diverged=[False, False, True, True])
    == 0.01
  )
  assert run_metrics.max_stable_lr(LRS, [float("inf")] * 4, 4.0) is None


def alternating(n, base=3.0, amplitude=0.01):
  return base + amplitude * (-1.0) ** np.arange(n)


def test_spike_score_one_planted_spike():
  x = alternating(2000)
  x[1500] = 3.5
  assert run_metrics.spike_score(x) == pytest.approx(100.0 / 1000)  # steps 1000..1999 are scored
  assert run_metrics.spike_score(x, window=100) == pytest.approx(100.0 / 1900)
  x[1500] = 3.0 + 0.06  # 6 sigma (sd of the window is exactly 0.01, mean exactly 3)
  assert run_metrics.spike_score(x, window=100) == 0.0
  x[1500] = 3.0 + 0.08  # 8 sigma
  assert run_metrics.spike_score(x, window=100) == pytest.approx(100.0 / 1900)


def test_spike_score_edges():
  x = alternating(300)
  assert math.isnan(run_metrics.spike_score(x))  # shorter than a full window: nothing scored
  assert run_metrics.spike_score(x, window=1000, min_history=100) == 0.0
  x[250] = float("nan")
  assert run_metrics.spike_score(x, window=100) == pytest.approx(100.0 / 200)
  drop = alternating(300)
  drop[200] = 2.0
  assert run_metrics.spike_score(drop, window=100) == 0.0
  assert run_metrics.spike_score(drop, window=100, two_sided=True) == pytest.approx(100.0 / 200)
  assert run_metrics.spike_score(np.full(50, 2.0), window=10) == 0.0  # constant: no spikes
  with pytest.raises(ValueError, match="series is empty"):
    run_metrics.spike_score([])
  with pytest.raises(ValueError, match="min_history"):
    run_metrics.spike_score(x, window=10, min_history=20)


def test_loss_spike_score_of_a_short_run():
  assert run_metrics.loss_spike_score([3.0, None]) is None  # too short
  losses = list(alternating(120))
  assert run_metrics.loss_spike_score(losses) == 0.0
  losses[100] = None  # a non-finite loss (JSON null) at a scored step is a spike
  window = 119
  assert run_metrics.loss_spike_score(losses) == pytest.approx(
    run_metrics.spike_score(
      np.array([np.nan if x is None else x for x in losses]), window=window, min_history=50
    )
  )
  assert run_metrics.loss_spike_score(losses) == pytest.approx(100.0 / 70)


def test_is_diverged():
  assert run_metrics.is_diverged(float("nan"), 3.0)
  assert run_metrics.is_diverged(float("inf"), 3.0)
  assert run_metrics.is_diverged(6.1, 3.0)
  assert not run_metrics.is_diverged(5.9, 3.0)
  assert run_metrics.is_diverged(4.0, 3.0, factor=1.2)
  flags = jax.jit(lambda l: run_metrics.is_diverged(l, 3.0))(jnp.array([1.0, jnp.nan, 7.0]))
  np.testing.assert_array_equal(flags, [False, True, True])


# ---------------------------------------------------------------------------
# Input errors and JSON.


@pytest.mark.parametrize(
  "fn",
  [stats.sink_rate, stats.first_token_attention, stats.attention_entropy, stats.attention_sparsity],
  ids=lambda f: f.__name__,
)
def test_wrong_rank_and_empty_raise(fn):
  with pytest.raises(ValueError, match=r"attention|weights"):
    fn(jnp.ones((4, 4)))
  with pytest.raises(ValueError, match="empty"):
    fn(jnp.ones((1, 2, 0, 0)))
  with pytest.raises(ValueError, match="empty list"):
    fn([])


def test_other_input_errors():
  with pytest.raises(ValueError, match=r"S >= T"):
    stats.sink_rate(jnp.ones((1, 1, 4, 3)))
  with pytest.raises(ValueError, match="1-indexed"):
    stats.sink_rate(heads(uniform_causal(4)), k=0)
  with pytest.raises(ValueError, match="eps"):
    stats.sink_rate(heads(uniform_causal(4)), eps=1.5)
  with pytest.raises(TypeError, match="floating"):
    stats.first_token_attention(jnp.ones((1, 1, 4, 4), jnp.int32))
  with pytest.raises(ValueError, match="hidden"):
    stats.massive_activations(jnp.ones((4, 4)))
  with pytest.raises(ValueError, match="sink_logits"):
    stats.null_mass(jnp.zeros((1, 2, 3, 3)))
  with pytest.raises(ValueError, match="multiple"):
    stats.qk_statistics(jnp.ones((1, 4, 3, 8)), jnp.ones((1, 4, 2, 8)))
  with pytest.raises(ValueError, match="same shape"):
    stats.kernel_approximation_error(jnp.ones((2, 3, 3)), jnp.ones((3, 3)))
  with pytest.raises(ValueError, match="k=2 needs the weights"):
    q, k, v = random_qkv(4)
    _, st = attnjax.dot_product_attention(q, k, v, is_causal=True, return_stats=True)
    stats.sink_rate(st, k=2)


def test_flatten_and_to_jsonable():
  T = 16
  w = heads(sink_head(T), uniform_causal(T))
  flat = stats.flatten(
    {"sink": stats.sink_rate(w), "drift": stats.output_logit_drift(jnp.array([[0.0, jnp.inf]]))}
  )
  assert set(flat) >= {"sink/rate", "sink/per_layer", "sink/importance", "drift/mean_log_z"}
  text = json.dumps(stats.to_jsonable(flat), allow_nan=False)
  back = json.loads(text)
  assert back["sink/rate"] == 50.0
  assert back["drift/mean_log_z"] is None  # inf -> null
  assert stats.to_jsonable({"a": np.array([1, 2]), "b": (np.float32(np.nan),)}) == {
    "a": [1, 2],
    "b": [None],
  }


def test_one_json_rule_for_metrics_and_run_directories(tmp_path):
  from attnjax._src.train import rundir

  record = {
    "loss": float("inf"),
    "drop": -np.inf,
    "nan": np.float32(np.nan),
    "per_layer": jnp.array([1.0, jnp.inf, -jnp.inf, jnp.nan]),
    "bf16": jnp.array([2.0, jnp.inf], jnp.bfloat16),
    "ints": np.arange(2),
    "flags": np.array([True, False]),
    "nested": ({"x": np.float64(0.5)},),
    "s": "a",
  }
  expected = {
    "loss": None,
    "drop": None,
    "nan": None,
    "per_layer": [1.0, None, None, None],
    "bf16": [2.0, None],
    "ints": [0, 1],
    "flags": [True, False],
    "nested": [{"x": 0.5}],
    "s": "a",
  }
  assert stats.to_jsonable(record) == expected
  assert json.loads(rundir.dumps(record)) == expected
  rundir.write_json(str(tmp_path / "s.json"), record)
  assert rundir.read_json(str(tmp_path / "s.json")) == expected
  with pytest.raises(TypeError, match="object"):
    stats.to_jsonable({"bad": object()})


def test_moved_names_say_where_they_went():
  for name, where in (
    ("probe", "attnjax.nn.layer_stats"),
    ("spike_score", "attnjax.train.metrics"),
    ("lr_sensitivity", "attnjax.train.metrics"),
  ):
    with pytest.raises(ImportError, match=where):  # also what `from attnjax.stats import x` says
      getattr(stats, name)
  with pytest.raises(AttributeError, match="no attribute"):
    stats.not_a_metric


# ---------------------------------------------------------------------------
# Probe.


def test_layer_stats_of_a_hand_built_capture():
  T, V = 16, 5
  layer = np.stack([sink_head(T)] * 3 + [uniform_causal(T)] * 5)[None]  # [1, 8, T, T]
  weights = jnp.asarray(np.stack([layer, layer]))  # [L=2, B=1, N=8, T, T]
  hidden = np.full((2, 1, T, 4), 0.05, np.float32)
  hidden[1, 0, 3, 2] = 400.0
  gate = jnp.stack([jnp.full((1, 8), 0.2), jnp.full((1, 8), jnp.nan)])  # layer 1 ungated
  capture = stats.LayerCapture(
    logits=jnp.zeros((1, T, V)), weights=weights, hidden=jnp.asarray(hidden), gate_mean=gate
  )
  out = attnjax.nn.layer_stats(capture)
  assert float(out["sink_rate/rate"]) == pytest.approx(37.5)
  f_attn = (3 * 0.5 + 5 * (harmonic(T) - 1) / (T - 1)) / 8
  np.testing.assert_allclose(out["f_attn/per_layer"], [f_attn, f_attn], rtol=1e-5)
  # Rows that sum to one: the raw first-token weight is F-Attn; halved rows halve it.
  np.testing.assert_allclose(out["f_attn/raw_per_layer"], [f_attn, f_attn], rtol=1e-5)
  halved = attnjax.nn.layer_stats(capture._replace(weights=weights * 0.5))
  assert float(halved["f_attn/raw"]) == pytest.approx(f_attn / 2, rel=1e-5)
  assert float(halved["f_attn/f_attn"]) == pytest.approx(f_attn, rel=1e-5)
  np.testing.assert_array_equal(out["massive/count"], [0, 1])
  assert float(out["output/mean_log_z"]) == pytest.approx(math.log(V), rel=1e-6)
  assert float(out["gate/mean"]) == pytest.approx(0.2)
  assert np.isnan(np.asarray(out["gate/per_layer"])[1])  # not defined -> null in JSON
  assert "max_logit" not in out and "qk/q_rms" not in out  # nothing to compute them from
  json.dumps(stats.to_jsonable(out), allow_nan=False)
  with pytest.raises(TypeError, match="LayerCapture"):
    attnjax.nn.layer_stats(lambda tokens: tokens, jnp.zeros((1, 64), jnp.int32))
  with pytest.raises(TypeError, match="view='sown'"):
    attnjax.nn.layer_stats(capture, view="sown")


# Options a family needs to be built at all (attnjax.nn rejects a sparse layer without a pattern).
FAMILY_OPTIONS = {
  "sparse": dict(pattern=("sliding_window", (("left", 4),))),
  # MLA: one latent shared by every head (no num_kv_heads), its own head dims.
  "mla": dict(num_kv_heads=None, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2),
}


def available_families(d_model=16):
  """Families of attnjax.nn that this build can run (others raise NotImplementedError)."""
  from flax import nnx

  found = []
  for family in attnjax.nn.specs.FAMILY_SPECS:
    config = attnjax.nn.AttentionConfig(
      family=family, num_heads=2, **FAMILY_OPTIONS.get(family, {})
    )
    try:
      attnjax.nn.Attention(config, d_model, rngs=nnx.Rngs(0))(jnp.zeros((1, 4, d_model)))
    except NotImplementedError:
      continue
    found.append(family)
  return found


def family_layer(family, **options):
  """A layer config of `family` with `options`, without the output gate if the family rejects it."""
  A = attnjax.nn.AttentionConfig
  options = {"num_heads": 4, "num_kv_heads": 2, **FAMILY_OPTIONS.get(family, {}), **options}
  try:
    return A(family=family, output_gate="headwise", **options)
  except ValueError:
    return A(family=family, **options)


def test_probe_sparsity_of_a_sparse_layer_counts_only_its_pattern():
  # sliding_window(left=0): each query sees only itself, with weight 1, so no
  # allowed entry is below the threshold. Counting the causal pairs the pattern
  # leaves out (weight 0) would report most of the matrix as sparse.
  from flax import nnx

  layer = attnjax.nn.AttentionConfig(
    family="sparse", num_heads=2, pattern=("sliding_window", (("left", 0),)), block_size=4
  )
  cfg = attnjax.nn.ModelConfig(vocab_size=32, d_model=16, num_layers=1, layer_attention=(layer,))
  model = attnjax.nn.TransformerLM(cfg, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 32)
  out = attnjax.nn.layer_stats(model, tokens, length=16)
  assert float(np.asarray(out["sparsity/per_layer"])[0]) == 0.0


@pytest.mark.slow  # ~16 s: every family's layer; each family's own tests take layer_stats
def test_probe_runs_on_every_nn_family():
  from flax import nnx

  # MLA's layer compares N key heads of d_n + d_r (the others: K = 2 heads of 4), so the
  # probe holds its q, k and v per layer rather than stacked.
  families = available_families()
  assert {"dense", "qk_norm", "cosine", "mla"} <= set(families)
  layers = [family_layer(f) for f in families] + [
    family_layer("dense", sink_logits=True),
    family_layer("dense", window=4, num_sinks=2, kv_bias=True),
    family_layer("dense", normalizer="softpick"),
  ]
  cfg = attnjax.nn.ModelConfig(
    vocab_size=32, d_model=16, num_layers=len(layers), layer_attention=tuple(layers)
  )
  model = attnjax.nn.TransformerLM(cfg, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(0), (2, 20), 0, 32)
  out = attnjax.nn.layer_stats(model, tokens, length=16)
  L = len(layers)
  for name in (
    "sink_rate/per_layer",
    "f_attn/per_layer",
    "entropy/min",
    "max_logit",
    "sparsity/per_layer",
    "qk/mean_cos",
    "sink_geometry/key_norm_ratio",
    "massive/max_abs",
    "kurtosis/per_layer",
    "gate/per_layer",
    "null_mass/per_layer",
  ):
    assert out[name].shape == (L,), name
  gated = np.array([layer.output_gate is not None for layer in layers])
  # Linear, gated and delta-rule attention have no softmax logits: their max logit is
  # undefined (NaN -> null).
  no_logits = ("linear",) + attnjax.nn.specs.GATED_FAMILIES
  has_logits = np.array([layer.family not in no_logits for layer in layers])
  for name, value in out.items():
    value = np.asarray(value)
    if name.startswith("gate/per_"):  # defined for gated layers only (NaN -> null elsewhere)
      assert np.all(np.isfinite(value[gated])) and np.all(np.isnan(value[~gated])), name
    elif name == "max_logit":
      assert np.all(np.isfinite(value[has_logits])) and np.all(np.isnan(value[~has_logits])), name
    elif name == "value_drain/per_head":  # [L, 4]: NaN past a layer's own 2 KV heads
      heads = np.array([4 if layer.family == "mla" else 2 for layer in layers])
      own = np.arange(value.shape[1])[None, :] < heads[:, None]
      assert value.shape == (L, 4) and np.all(np.isfinite(value[own])), name
      assert np.all(np.isnan(value[~own])), name
    else:
      assert np.all(np.isfinite(value)), name
  null = np.asarray(out["null_mass/per_layer"])
  assert null[len(families)] > 0 and np.all(null[: len(families)] == 0)  # only sink-logit layer
  json.dumps(stats.to_jsonable(out), allow_nan=False)
  with pytest.raises(ValueError, match="length=64"):
    attnjax.nn.layer_stats(model, tokens, length=64)


LAYER_CASES = {
  "dense_window": dict(family="dense", window=3),
  "qk_norm_before_rope": dict(family="qk_norm", qk_norm_placement="before_rope"),
  "qk_norm_after_rope": dict(family="qk_norm", qk_norm_placement="after_rope"),
  "sinks_window": dict(family="dense", window=4, num_sinks=2),
  "sparse_strided": dict(family="sparse", pattern=("strided", (("stride", 3),)), block_size=4),
}


@pytest.mark.parametrize("name", sorted(LAYER_CASES))
def test_layer_gives_the_probe_its_mask_and_compared_qk(name):
  # softmax(scale * <q, k>) over allowed_mask, with q and k from compared_qk,
  # must be the weights the layer itself used: the probe asks the layer
  # instead of re-deriving its mask, QK norm placement, gains or RoPE.
  from flax import nnx
  from attnjax._src.nn import intermediates

  config = attnjax.nn.AttentionConfig(
    num_heads=4, num_kv_heads=2, rope_theta=100.0, **LAYER_CASES[name]
  )
  layer = attnjax.nn.Attention(config, 16, rngs=nnx.Rngs(0))
  if config.family == "qk_norm":  # gains away from 1, so their placement matters
    layer.q_gain[...] = jnp.linspace(0.5, 2.0, layer.head_dim)
    layer.k_gain[...] = jnp.linspace(2.0, 0.5, layer.head_dim)
  B, T, N, K, H = 2, 12, 4, 2, layer.head_dim
  x = jax.random.normal(jax.random.key(1), (B, T, 16))
  _, inter = nnx.capture(
    lambda m, x: m(x, sow_weights=True), nnx.Intermediate, method_outputs=nnx.Intermediate
  )(layer, x)
  recorded = intermediates.read(inter).model
  q = jnp.reshape(recorded["q_proj/__call__"], (B, T, N, H))
  k = jnp.reshape(recorded["k_proj/__call__"], (B, T, K, H))
  q, k = layer.compared_qk(q, k)
  allowed = layer.allowed_mask(T)
  assert allowed.shape == (1, 1, T, T) and allowed.dtype == jnp.bool_
  z = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, N // K, axis=2)) * H**-0.5
  w = jax.nn.softmax(jnp.where(allowed, z, -jnp.inf), axis=-1)
  np.testing.assert_allclose(w, recorded["weights"], atol=2e-6)
  # Explicit positions equal to the default give the same q and k.
  q2, _ = layer.compared_qk(
    jnp.reshape(recorded["q_proj/__call__"], (B, T, N, H)), k, positions=jnp.arange(T)
  )
  np.testing.assert_allclose(q2, q, rtol=1e-6)


def test_allowed_mask_of_sinks_window_and_kv_bias():
  from flax import nnx

  config = attnjax.nn.AttentionConfig(num_heads=2, window=2, num_sinks=1, kv_bias=True)
  layer = attnjax.nn.Attention(config, 8, rngs=nnx.Rngs(0))
  allowed = np.asarray(layer.allowed_mask(5))[0, 0]
  i, j = np.arange(5)[:, None], np.arange(5)[None, :]
  expected = (j <= i) & ((i - j <= 2) | (j < 1))
  np.testing.assert_array_equal(allowed[:, :5], expected)
  assert allowed.shape == (5, 6) and allowed[:, 5].all()  # the k/v bias slot: every query
  with pytest.raises(ValueError, match="length"):
    layer.allowed_mask(0)


def test_one_reader_serves_every_view_and_the_train_step():
  from flax import nnx
  from attnjax._src.nn import intermediates
  from attnjax._src.train import step

  layers = (family_layer("dense"), family_layer("qk_norm", window=3))
  cfg = attnjax.nn.ModelConfig(vocab_size=32, d_model=16, num_layers=2, layer_attention=layers)
  model = attnjax.nn.TransformerLM(cfg, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(0), (2, 10), 0, 32)
  collected = attnjax.nn.layer_stats(model, tokens, view="sown", jit=False)
  _, inter = nnx.capture(lambda m, t: m(t), nnx.Intermediate)(model, tokens)
  by_layer = step.attention_stats_by_layer(inter)
  capture = attnjax.nn.layer_stats(model, tokens, view="capture", weights=False, jit=False)
  assert len(by_layer) == len(collected["layers"]) == 2
  for l in range(2):
    np.testing.assert_allclose(collected["layers"][l]["sink_mass"], by_layer[l].sink_mass)
    np.testing.assert_allclose(capture.attention_stats.sink_mass[l], by_layer[l].sink_mass)
  recorded = intermediates.read(inter)
  assert set(recorded.model) == {"log_z"}
  assert "attention/attention_stats" in recorded.layers[1]
  assert "hidden_max_abs" in recorded.layers[1]
  same = intermediates.read(nnx.to_pure_dict(inter), num_layers=3)  # a pure dict reads alike
  assert same.layers[2] == {} and set(same.layers[0]) == set(recorded.layers[0])
  assert intermediates.find(recorded.layers[0], "q_rms") is recorded.layers[0]["attention/q_rms"]
