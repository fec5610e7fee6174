"""python experiments/favor_approx.py --config experiments/configs/favor_approx.py:preset=cpu

Random-feature approximation of softmax attention (Choromanski et al. 2021),
no training: relative Frobenius error
||A_hat - A||_F / ||A||_F of causal attention with m random features against
exact softmax attention, for FAVOR+ (positive) features, orthogonal and i.i.d.,
and trigonometric features, over several draws. Expected: error falls like
1/sqrt(m); positive orthogonal features do best. Arguments after ``:``:
``preset`` (cpu: T=256, H=64, 4 heads, 5 draws, a few seconds; gpu/tpu: T=1024, 10 draws).
"""

import ml_collections

from attnjax.train.config import parse_arg


def get_config(arg=None):
  a = parse_arg(arg, preset="cpu")
  c = ml_collections.ConfigDict()
  c.preset = a.preset
  c.seed = 0
  c.seq_len = 256 if a.preset == "cpu" else 1024
  c.head_dim = 64
  c.num_heads = 4
  c.batch_size = 1
  # q, k ~ N(0, q_std^2): logits q.k / sqrt(H) have std q_std^2, and the
  # estimator's relative variance grows like exp(|q + k|^2 / sqrt(H)) / m (Choromanski
  # et al., Lemma 2), about exp(4 q_std^2 H / sqrt(H) / 2) / m: at q_std = 1, H = 64 it
  # needs m >> e^16 features; q_std = 0.5 shows the 1/sqrt(m) regime.
  c.q_std = 0.5
  c.draws = 5 if a.preset == "cpu" else 10
  c.num_features = "16,32,64,128,256,512,1024"
  c.maps = "favor_plus_orthogonal,favor_plus_iid,trig_iid,trig_orthogonal"
  return c
