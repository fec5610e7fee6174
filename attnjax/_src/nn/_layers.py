"""Small shared pieces: initialisers with logical sharding names, dtype names, capture test,
the linear layer (which fake-quantises under :func:`fake_quantization`)."""

from __future__ import annotations

import contextlib
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from attnjax._src.stats.outliers import fake_quantize

# Wortsman et al. 2023 (sec. 2): weights from a truncated normal with std 1 / sqrt(fan_in).
# variance_scaling corrects the std for the truncation.
fan_in_init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


def with_names(init, names: tuple[Optional[str], ...]):
  """Adds logical axis names (``"embed"``, ``"heads"``, ``"mlp"``, ``"vocab"``) as metadata.

  The names are stored as the variable's ``out_sharding`` metadata, read by
  ``nnx.get_partition_spec`` / ``nnx.logical_to_mesh_sharding``. Eager sharding
  is off, so a model can be built without a mesh; a train loop shards the
  state with its own rules.
  """
  return nnx.with_partitioning(init, names, eager_sharding=False)


def param(value, names: tuple[Optional[str], ...]) -> nnx.Param:
  return nnx.Param(value, out_sharding=names, eager_sharding=False)


# The bit width of fake quantisation while a forward is traced under fake_quantization().
_QUANTIZATION: list = [None]


@contextlib.contextmanager
def fake_quantization(bits: int):
  """Traces every :class:`Linear` (and the output projection) with W``bits``A``bits`` fake
  quantisation: per-tensor symmetric weights, asymmetric inputs (``stats.fake_quantize``).

  Read at trace time: use it inside the jitted function, around the forward it changes.
  """
  previous = _QUANTIZATION[0]
  _QUANTIZATION[0] = bits
  try:
    yield
  finally:
    _QUANTIZATION[0] = previous


def quantization_bits() -> Optional[int]:
  return _QUANTIZATION[0]


def quantize_input(x):
  """``x`` fake-quantised (asymmetric) when tracing under :func:`fake_quantization`."""
  bits = _QUANTIZATION[0]
  return x if bits is None else fake_quantize(x, bits=bits, symmetric=False)


def quantize_weight(w):
  bits = _QUANTIZATION[0]
  return w if bits is None else fake_quantize(w, bits=bits, symmetric=True)


class Linear(nnx.Linear):
  """``nnx.Linear`` whose weight and input are fake-quantised under :func:`fake_quantization`."""

  def __call__(self, inputs):
    if _QUANTIZATION[0] is None:
      return super().__call__(inputs)
    x = quantize_input(inputs).astype(self.dtype)
    kernel = quantize_weight(self.kernel[...]).astype(self.dtype)
    y = jnp.einsum("...i,io->...o", x, kernel)
    if self.bias is not None:
      y = y + jnp.reshape(self.bias[...].astype(self.dtype), (1,) * (y.ndim - 1) + (-1,))
    return y


def linear(
  d_in: int,
  d_out: int,
  names: tuple[Optional[str], Optional[str]],
  *,
  rngs: nnx.Rngs,
  dtype,
  param_dtype,
  use_bias: bool = False,
) -> nnx.Linear:
  return Linear(
    d_in,
    d_out,
    use_bias=use_bias,
    dtype=dtype,
    param_dtype=param_dtype,
    kernel_init=with_names(fan_in_init, names),
    bias_init=with_names(jax.nn.initializers.zeros, (names[1],)),
    precision=None,
    rngs=rngs,
  )


def dtype_of(name) -> jnp.dtype:
  return jnp.dtype(name)


def capturing(module: nnx.Module) -> bool:
  """True inside ``nnx.capture(..., nnx.Intermediate)``: only then are statistics computed.

  Sowing outside ``nnx.capture`` is deprecated in flax 0.12 (it adds attributes
  to the module), and computing statistics on every training step would rule
  out the platform kernels; so modules sow only when someone is listening.
  """
  return any(type(v) is nnx.Intermediate for v in getattr(module, "__captures__", ()))


def sow(module: nnx.Module, name: str, value) -> None:
  if capturing(module):
    module.sow(nnx.Intermediate, name, value)
