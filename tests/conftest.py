"""Test configuration: strict numpy rank promotion and float32 matmuls, as nanodo does."""

import os

# Multi-device code is tested on the CPU with 8 host devices; set before jax imports.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")
