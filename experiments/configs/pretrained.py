"""python experiments/pretrained.py --model DIR --text FILE

(The default ``--config experiments/configs/pretrained.py:preset=cpu``.)

Attention sinks of a pretrained checkpoint (a Hugging Face format directory:
``config.json`` + ``*.safetensors``, any ``attnjax.models.SUPPORTED`` type), measured on
a text: per layer and head, Sink_1^eps against eps (Gu et al. 2024), the first-token
weight and F-Attn (Qiu et al. 2025), the value-state drain (Guo et al. 2024), per layer
M-Act (Sun et al. 2024) and the null mass of sink logits, and the text's perplexity. The
statistics come from the fused attention pass (``return_stats``), so no T x T weights
are materialised. Arguments after ``:``: ``preset``:

- ``cpu``: sequences of 2048 tokens, one at a time, block-wise attention;
- ``gpu`` / ``tpu``: sequences of 32768 tokens (the long-context probe);
- ``long``: 32768 tokens on a CPU (block-wise; minutes for a small model).

``--text`` is a text file (tokenised by the checkpoint's ``tokenizer.json`` through the
optional ``tokenizers`` package) or token ids: ``.npy`` (any integer dtype) or ``.bin``
(``--config.bin_dtype``, uint16 as nanoGPT writes them). Each sequence starts with the
checkpoint's BOS token (``--config.add_bos=False`` to keep the text's own first token).
"""

import ml_collections

from attnjax.train.config import parse_arg


def get_config(arg=None):
  a = parse_arg(arg, preset="cpu")
  c = ml_collections.ConfigDict()
  c.preset = a.preset
  c.model = ""  # the checkpoint directory (or --model)
  c.text = ""  # the text or token file (or --text)
  c.seq_len = 2048 if a.preset == "cpu" else 32768
  c.num_sequences = 1  # consecutive sequences of the text, each one forward
  c.add_bos = True  # start each sequence with the checkpoint's bos_token_id
  c.bin_dtype = "uint16"  # dtype of .bin token files
  c.dtype = ""  # "" = the checkpoint's; or float32 / bfloat16
  # Block-wise attention computes the statistics in the fused pass (O(T) memory); the
  # reference would materialise T x T weights per layer.
  c.implementation = "blockwise"
  c.attention = ""  # more attnjax attention options, "key=value,key=value"
  c.sink_eps = "0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9"
  c.loss_chunk = 512  # positions per output-logit chunk of the perplexity
  return c
