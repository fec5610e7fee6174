"""Pretrained checkpoints (Hugging Face format) as the project's own ``nn.TransformerLM``.

Implementation behind the public module :mod:`attnjax.models`, which names what it offers
from the modules of this package.
"""
