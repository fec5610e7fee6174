"""Per-family attention specs: each family's options, parameters, attention call and cache.

An :class:`attnjax.nn.AttentionConfig` holds the options every layer has
(heads, head dim, RoPE, output gate, causality, implementation) and one *spec*,
a frozen dataclass of its family's options that also knows how to

- build the family's parameters on the layer (:meth:`.AttentionSpec.init_params`),
- call the family's pure function with the layer's q, k, v, masks and learned
  arrays, for self-attention, cross-attention and decoding
  (:meth:`.AttentionSpec.attend`),
- make its decode cache (:meth:`.AttentionSpec.init_cache`),
- say which pairs its training forward allows and what q/k it compares
  (:meth:`.AttentionSpec.allowed_mask`, :meth:`.AttentionSpec.compared_qk`).

``Attention`` never branches on the family: a new family is one new spec class
registered with :func:`.register_family`, e.g.::

  @dataclasses.dataclass(frozen=True)
  class MemoryCompressedSpec(DenseSpec):
    family: ClassVar[str] = "memory_compressed"
    stride: int = 2
    ...
  register_family(MemoryCompressedSpec)

Families: ``dense`` (:class:`.DenseSpec`), ``qk_norm`` (:class:`.QKNormSpec`),
``cosine`` (:class:`.CosineSpec`) share the dense kernel (:class:`.DotProductSpec`:
normalisers, sink logits, softcap, the k/v bias slot, windows and sinks);
``sparse`` (:class:`.SparseSpec`) a block-sparse pattern; ``linear``
(:class:`.LinearSpec`) kernel feature maps with a recurrent decode state;
``retnet``, ``mamba2_decay``, ``gla``, ``deltanet``, ``gated_deltanet``
(``attnjax.nn.gated_spec``) gated and delta-rule recurrent states;
``block_select`` (:class:`.BlockSelectSpec`) content-selected key blocks (MoBA);
``compressed`` (:class:`.CompressedSpec`) memory-compressed keys and values
(a learned strided convolution or a Linformer projection) plus a raw window.
"""

from attnjax._src.nn.specs import (DEFAULT_TEMPERATURE, FAMILY_SPECS, FEATURE_MAPS, GATED_FAMILIES,
                                   PATTERNS, STREAMING_ROPE, AttentionSpec, BlockSelectCache,
                                   BlockSelectSpec, Call, CompressedSpec, CosineSpec, DeltaNetSpec,
                                   DenseSpec, DotProductSpec, GLASpec, GatedDeltaNetSpec,
                                   GatedSpec, LinearSpec, Mamba2DecaySpec, QKNormSpec, RetNetSpec,
                                   ScoreSpec, SparseSpec, register_family)

__all__ = ["DEFAULT_TEMPERATURE", "FAMILY_SPECS", "FEATURE_MAPS", "GATED_FAMILIES", "PATTERNS",
    "STREAMING_ROPE", "AttentionSpec", "BlockSelectCache", "BlockSelectSpec", "Call",
    "CompressedSpec", "CosineSpec", "DeltaNetSpec", "DenseSpec", "DotProductSpec", "GLASpec",
    "GatedDeltaNetSpec", "GatedSpec", "LinearSpec", "Mamba2DecaySpec", "QKNormSpec", "RetNetSpec",
    "ScoreSpec", "SparseSpec", "register_family"]
