"""attnjax.data: tokenisers, corpora and their splits, deterministic batches with BOS, bigram-backcopy."""

import os

import ml_collections
import numpy as np
import pytest

from attnjax import data
from attnjax._src.data import corpus
from attnjax._src.train.config import base_config


def test_char_tokenizer_round_trip_and_reserved_ids():
  tok = data.CharTokenizer.from_text("to be or not")
  ids = tok.encode("not to be")
  assert tok.decode(ids) == "not to be"
  assert ids.min() >= 2 and tok.bos_id == 0
  assert tok.vocab_size == len(set("to be or not")) + 2
  assert tok.encode("z")[0] == data.CharTokenizer.UNK


def test_byte_tokenizer_round_trip_utf8():
  tok = data.ByteTokenizer()
  text = "Fair is foul — and foul is fair"
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert ids.max() < 256 and tok.bos_id == 256 and tok.vocab_size == 257


def test_shakespeare_split_by_play_is_disjoint_complete_and_deterministic():
  d = data.load_shakespeare()
  names = corpus.list_documents(data.shakespeare_dir(), "**/*.md")
  assert len(names) >= 30
  assert set(d.train_files).isdisjoint(d.val_files)
  assert sorted(d.train_files + d.val_files) == names
  assert 2 <= len(d.val_files) <= len(names) // 4
  # Same split and ids again (a fresh split, not the cache).
  again = data.split_documents(names, 0.1)
  assert tuple(again[1]) == d.val_files
  assert d.unit == "char" and d.train.dtype == np.uint16
  # Text of a validation play never appears among the train plays' ids: spot check.
  tok = d.tokenizer
  val_text = tok.decode(d.val[:2000])
  assert "# " in val_text  # Markdown title of the first validation play


def test_split_documents_needs_two():
  with pytest.raises(ValueError, match="at least 2 documents"):
    data.split_documents(["only.md"], 0.1)


@pytest.mark.parametrize("tokenizer", ["char", "byte"])
def test_text_file_and_folder(tmp_path, tokenizer):
  f = tmp_path / "one.txt"
  f.write_text("abcdefghij" * 50)
  d = data.load_text(str(f), tokenizer=tokenizer, val_fraction=0.2)
  assert len(d.train) == 400 and len(d.val) == 100
  folder = tmp_path / "docs"
  folder.mkdir()
  for i in range(4):
    (folder / f"doc{i}.txt").write_text(f"document {i} " * 20)
  d = data.load_text(str(folder), tokenizer=tokenizer, val_fraction=0.25)
  assert d.val_files and set(d.train_files).isdisjoint(d.val_files)
  assert len(d.train_files) + len(d.val_files) == 4


def test_missing_path_names_the_key(tmp_path):
  with pytest.raises(FileNotFoundError, match="data.path"):
    data.load_text(str(tmp_path / "nope.txt"))


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_memmap_layout(tmp_path, dtype):
  rng = np.random.default_rng(0)
  np.asarray(rng.integers(0, 1000, 5000), dtype).tofile(tmp_path / "train.bin")
  np.asarray(rng.integers(0, 1000, 800), dtype).tofile(tmp_path / "val.bin")
  d = data.load_bin(str(tmp_path), vocab_size=1000, dtype=dtype)
  assert isinstance(d.train, np.memmap) and len(d.train) == 5000
  assert d.bos_id == 1000 and d.vocab_size == 1001
  b = data.CorpusBatches(d, seq_len=32, batch_size=4, seed=0).batch("train", 7)
  assert (b.inputs[:, 0] == 1000).all() and b.targets.max() < 1000
  with pytest.raises(FileNotFoundError, match="val.bin"):
    os.remove(tmp_path / "val.bin")
    data.load_bin(str(tmp_path), vocab_size=1000, dtype=dtype)


def _config(**data_changes):
  c = base_config().data
  c.update(dict(dict(seq_len=32, batch_size=4), **data_changes))
  return c


@pytest.mark.parametrize("name", ["shakespeare", "bigram_backcopy"])
def test_batches_are_a_pure_function_of_seed_and_step_with_bos(name):
  cfg = _config(name=name)
  a = data.from_config(cfg, seed=3)
  b = data.from_config(cfg, seed=3)  # a fresh object: nothing stateful is shared
  for step in (0, 5, 123):
    x, y = a.batch("train", step), b.batch("train", step)
    np.testing.assert_array_equal(x.inputs, y.inputs)
    np.testing.assert_array_equal(x.targets, y.targets)
    assert x.inputs.shape == (4, 32) and x.inputs.dtype == np.int32
    assert (x.inputs[:, 0] == a.bos_id).all()
    assert not (x.inputs[:, 1:] == a.bos_id).any()
    np.testing.assert_array_equal(x.inputs[:, 1:], x.targets[:, :-1])
  assert not np.array_equal(a.batch("train", 0).inputs, a.batch("train", 1).inputs)
  assert not np.array_equal(a.batch("train", 0).inputs, a.batch("val", 0).inputs)
  other = data.from_config(cfg, seed=4)
  assert not np.array_equal(a.batch("train", 0).inputs, other.batch("train", 0).inputs)
  # Probe batches: fixed length 64 on held-out data, same every call.
  p = a.batch("heldout", 0, seq_len=64, batch_size=2)
  assert p.inputs.shape == (2, 64) and (p.inputs[:, 0] == a.bos_id).all()


def test_validation_batches_come_from_validation_plays():
  b = data.from_config(_config(name="shakespeare", seq_len=256), seed=0)
  tok = b.data.tokenizer
  val_text = tok.decode(b.data.val)
  window = tok.decode(b.batch("val", 0).targets[0])
  assert window in val_text


def test_bigram_backcopy_follows_its_rule():
  bb = data.BigramBackcopyBatches(vocab_size=16, num_triggers=3, seq_len=64, batch_size=64, seed=1)
  seq = np.concatenate([bb.batch("train", 0).inputs, bb.batch("train", 0).targets[:, -1:]], 1)
  tokens = seq[:, 1:]  # drop BOS
  transition, triggers = bb.chain()
  np.testing.assert_allclose(transition.sum(1), 1.0)
  assert not np.isin(tokens[:, 0], triggers).any()  # the first token is never a trigger
  copies = 0
  for t in range(1, tokens.shape[1] - 1):
    after = np.isin(tokens[:, t], triggers)
    np.testing.assert_array_equal(tokens[after, t + 1], tokens[after, t - 1])
    copies += after.sum()
  assert copies > 50
  # Non-trigger successors follow the chain: only transitions with positive probability.
  prev, nxt = tokens[:, :-1].ravel(), tokens[:, 1:].ravel()
  plain = ~np.isin(prev, triggers)
  assert (transition[prev[plain], nxt[plain]] > 0).all()


@pytest.mark.parametrize(
  "key,value,match",
  [
    ("name", "wiki", "data.name"),
    ("seq_len", 1, "data.seq_len"),
    ("batch_size", 0, "data.batch_size"),
  ],
)
def test_from_config_errors_name_the_key(key, value, match):
  cfg = _config()
  cfg[key] = value
  with pytest.raises(ValueError, match=match):
    data.from_config(cfg, seed=0)


def test_text_source_needs_a_path():
  with pytest.raises(ValueError, match="data.path"):
    data.from_config(_config(name="text"), seed=0)


def test_seq_len_longer_than_split_is_rejected(tmp_path):
  (tmp_path / "tiny.txt").write_text("abc" * 10)
  cfg = _config(name="text", path=str(tmp_path / "tiny.txt"), seq_len=64)
  with pytest.raises(ValueError, match="data.seq_len"):
    data.from_config(cfg, seed=0)
  assert isinstance(cfg, ml_collections.ConfigDict)


def test_packing_needs_documents(tmp_path):
  cfg = base_config().data
  cfg.update(dict(name="bigram_backcopy", pack=True))
  with pytest.raises(ValueError, match="data.pack"):
    data.from_config(cfg, seed=0)
  f = tmp_path / "one.txt"
  f.write_text("first line\nsecond line\n" * 40)
  cfg.update(dict(name="text", path=str(f), seq_len=16, batch_size=4))
  batches = data.from_config(cfg, seed=0)
  b = batches.batch("val", 2)
  assert b.packed and b.inputs[0, 0] == batches.bos_id
  # Every document is a whole line: a BOS is followed by "first" or "second".
  tok = batches.data.tokenizer
  for r, t in zip(*np.nonzero(b.inputs == batches.bos_id)):
    rest = tok.decode(b.inputs[r, t + 1 :])
    assert "first line".startswith(rest[:10]) or "second line".startswith(rest[:11])
  unpacked = data.CorpusBatches(batches.data, seq_len=16, batch_size=4, seed=0)
  assert not unpacked.batch("val", 2).packed
  bins = data.TokenData(
    train=np.arange(100, dtype=np.uint16),
    val=np.arange(50, dtype=np.uint16),
    vocab_size=101,
    bos_id=100,
    unit="token",
  )
  with pytest.raises(ValueError, match="data.pack"):
    data.CorpusBatches(bins, seq_len=8, batch_size=2, pack=True)
