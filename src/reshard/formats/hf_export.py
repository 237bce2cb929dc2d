"""Training checkpoint <-> Hugging Face safetensors.

* :func:`export_hf` consolidates a (sharded) reshard checkpoint into a Hugging
  Face model directory: ``model.safetensors`` when one shard suffices, else
  ``model-00001-of-0000N.safetensors`` ... plus ``model.safetensors.index.json``
  (``{"metadata": {"total_size": <bytes>}, "weight_map": {name: file}}``).
  Streaming and bounded in memory: shards are planned from the manifest alone
  (names, dtypes, shapes), each shard's safetensors header is written first,
  then its tensors one at a time, each read by :func:`reshard.load` of one
  full-width request (checksums verified), cast if asked, written, freed. A
  tensor larger than ``READ_BLOCK_BYTES`` (32 MiB) is requested in blocks of
  whole rows (flat element ranges for ZeRO/FSDP flat shards), so peak extra
  memory is a few such blocks (the block, the reader's span buffers, the
  cast copy), whatever the size of the model or of its largest tensor. Buffers are anonymous memory maps, given back to
  the OS when freed.
* :func:`import_hf` loads a Hugging Face directory (one ``model.safetensors``
  or an index over several shards) into a (sharded) target state: the
  safetensors headers become a reshard :class:`~reshard.ondisk.manifest.Manifest`
  (one chunk per tensor, absolute byte ranges), and :func:`reshard.load` reads
  through it, so each rank reads only the byte ranges its shards need.

Units: sizes in bytes; ``max_shard_bytes`` counts tensor bytes only (not the
headers), as Hugging Face's ``max_shard_size`` does; ``total_size`` in the
index is the sum of tensor bytes.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from ..adapters.names import unwrapped_names
from ..collectives import SingleProcess
from ..loading.load import _read_or_dcp
from ..ondisk.manifest import Manifest, TensorEntry
from ..options import LoadOptions
from ..progress import bar, wanted
from ..state.sharding import (
    dtype_name,
    torch_dtype,
)
from ..storage import LocalStorage, Storage, local_path, resolve
from .hf_store import _SHARD_RX, INDEX_NAME, SINGLE_NAME, write_shards
from .hf_write import TIED_KEY, _fsync_dir, _fsync_file, _Item, _write_shard

#: the safetensors format's own cap on a header (bytes)
MAX_HEADER_BYTES = 100_000_000
#: an index larger than this is refused before it is read (bytes)
MAX_INDEX_BYTES = 256 << 20

_DTYPE_ALIASES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "f16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "f32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp64": torch.float64, "f64": torch.float64, "float64": torch.float64,
}

_SIZE_RX = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


def parse_dtype(d: str | torch.dtype) -> torch.dtype:
    """``"bf16"``, ``"bfloat16"``, ``"fp16"``, ``"fp32"``, ... or a torch dtype."""
    if isinstance(d, torch.dtype):
        dtype_name(d)  # on the allow-list
        out = d
    else:
        try:
            out = _DTYPE_ALIASES[d.strip().lower()]
        except KeyError:
            raise ValueError(f"unknown dtype {d!r} (use one of {', '.join(sorted(_DTYPE_ALIASES))})") from None
    if not out.is_floating_point:
        raise ValueError(f"export dtype must be a floating-point dtype (it casts float tensors), got {out}")
    return out


def parse_size(s: str | int) -> int:
    """A byte count: an int, or ``"2GB"`` (decimal, 2e9, as Hugging Face reads
    ``max_shard_size``), ``"2GiB"`` (binary, 2 * 2**30), ``"500MB"``, ``"64KiB"``..."""
    if isinstance(s, bool):
        raise ValueError(f"not a size: {s!r}")
    if isinstance(s, int):
        n = s
    else:
        mt = _SIZE_RX.match(s)
        if mt is None:
            raise ValueError(f"not a size: {s!r} (e.g. 2GB, 500MiB, 1048576)")
        unit = (mt.group(2) or "b").lower()
        base = 1024 if "i" in unit else 1000
        power = {"b": 0, "k": 1, "m": 2, "g": 3, "t": 4}[unit[0]]
        n = int(float(mt.group(1)) * base**power)
    if n <= 0:
        raise ValueError(f"size must be positive, got {s!r}")
    return n


# ----------------------------------------------------------------------------- export


@dataclass(frozen=True, kw_only=True)
class ExportResult:
    """What :func:`export_hf` wrote.

    Attributes:
        out_dir: the Hugging Face directory.
        files: shard file names, in order.
        index_file: ``model.safetensors.index.json``, or None for one shard.
        weight_map: output tensor name -> shard file name.
        total_size: bytes of tensor data written (the index's ``total_size``).
        skipped: checkpoint fqns not exported (excluded by ``include``, e.g.
            optimizer state; tied aliases unless ``include_aliases``).
        aliases: output name of each tied alias -> the output name of the
            tensor it shares storage with (exported or not).
        copied: names of the files copied alongside.
        bytes_read: bytes read from the checkpoint.
        bytes_written: bytes of the shard files (headers included).
        duration_s: seconds the export took.
    """

    out_dir: str
    files: tuple[str, ...]
    index_file: str | None
    weight_map: dict[str, str]
    total_size: int
    skipped: tuple[str, ...] = ()
    aliases: dict[str, str] = field(default_factory=dict)
    copied: tuple[str, ...] = ()
    bytes_read: int = 0
    bytes_written: int = 0
    duration_s: float = 0.0


def _include_fn(include: Any) -> Callable[[str], bool]:
    if include is None:  # optimizer state is never a weight (trainer state is left out by _subtree)
        return lambda fqn: not fqn.startswith("optim.") and not _OPTIM_RX.search(fqn)
    if callable(include):
        return include
    pats = [include] if isinstance(include, str) else list(include)
    return lambda fqn: any(fnmatch.fnmatchcase(fqn, p) for p in pats)


def _output_names(m: Manifest, transforms: Sequence[Any]
                  ) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    """``({output name: saved fqn} of tensors, {output alias: (saved alias,
    output name of its target)})``
    after the manifest-level transforms (Rename, Reset)."""
    from ..transforms import manifest_view

    for t in transforms:
        if not hasattr(t, "apply_manifest"):
            raise ValueError(f"export_hf: {type(t).__name__} changes geometry or dtype at load; only "
                             "transforms that act on saved names (Rename, Reset) apply to an export")
    # distinct entry objects, so that each renamed entry maps back to its saved fqn by identity
    fresh = {k: TensorEntry(te.dtype, te.global_shape, te.chunks) for k, te in m.tensors.items()}
    back = {id(te): k for k, te in fresh.items()}
    view = manifest_view(msgspec.structs.replace(m, tensors=fresh), transforms)
    names: dict[str, str] = {}
    for out, te in view.tensors.items():
        if not out:
            raise ValueError("export_hf: a transform renamed a tensor to the empty name")
        saved = back.get(id(te))
        if saved is None:
            raise ValueError(f"export_hf: tensor {out!r} is made by a transform, not saved")
        names[out] = saved
    # Rename maps alias names in order (and Reset keeps them): pair them up
    aliases: dict[str, tuple[str, str]] = {}
    if len(view.aliases) == len(m.aliases):
        for (out_alias, out_target), saved_alias in zip(view.aliases.items(), m.aliases, strict=True):
            aliases[out_alias] = (saved_alias, out_target)
    return names, aliases


#: optimizer state in a tree without a record of its adapters: a component
#: ``optim``/``optimizer``/``optimizers`` (or ``optim_*``...) followed by
#: ``state``, ``param_group`` or ``param_groups``
_OPTIM_RX = re.compile(r"(^|\.)(optim|optimizer|optimizers|optim_\w+|optimizer_\w+)\."
                       r"(state|param_group|param_groups)(\.|$)")
_OPTIM_NAME_RX = re.compile(r"^(optim|optimizer|optimizers|optim_\w+|optimizer_\w+)$")
#: kinds of :attr:`Manifest.adapters` that hold model weights, and where below them
_MODEL_KINDS = {"ModelState": "", "TorchState": "model"}
#: trainer state, never model weights, whatever the trainer's layout: a component
#: that names it (TorchTitan's ``train_state``, ``lr_scheduler``, ``dataloader``;
#: schedulers, loaders, RNG and loss-scaler state of other loops)
_TRAINER_RX = re.compile(r"(^|\.)(train_state|trainer_state|training_state|lr_scheduler|lr_schedulers|"
                         r"dataloader|dataloaders|data_loader|rng|rng_state|rng_states|grad_scaler)"
                         r"(\.|$)")
#: a 0-dim integer tensor with one of these names at the top of the model's
#: subtree is a loop counter saved beside the weights, not a weight
_COUNTERS = frozenset({"step", "steps", "global_step", "epoch", "iteration", "iter", "num_steps",
                       "consumed_samples", "consumed_tokens", "ntokens_seen", "tokens_seen"})


def trainer_state(name: str, te: TensorEntry | None = None) -> bool:
    """Whether the tensor ``name`` (relative to the model's subtree; ``te`` its
    entry) is trainer state rather than a model weight: under a component
    that names trainer state (:data:`_TRAINER_RX`: ``train_state.step``,
    ``lr_scheduler.*``, ``dataloader.*``), or a 0-dim integer counter
    (``step``, ``epoch``, ...) at the top. An export never writes one."""
    if _TRAINER_RX.search(name):
        return True
    return (te is not None and "." not in name and name in _COUNTERS and not te.global_shape
            and not torch_dtype(te.dtype).is_floating_point)


def _under(name: str, path: str) -> bool:
    return not path or name == path or name.startswith(path + ".")


def model_candidates(m: Manifest) -> tuple[list[str], list[str]]:
    """``(candidates, excluded)``: the tree paths that hold a model in ``m``
    (from :attr:`Manifest.adapters`: a ``ModelState``, the ``model`` part of a
    ``TorchState``, a plain mapping of tensors such as ``model.state_dict()``
    or the ``"model"`` entry of an ``AppState`` built on ``get_state_dict``),
    and the paths whose tensors are never model weights (optimizer state,
    RNG, data cursor). Without a record (checkpoints written before it, DCP
    directories): tensors whose names look like optimizer state are excluded
    and the single candidate is the longest component prefix that every other
    tensor (and tied alias) name shares."""
    from ..state.tree import NON_MODEL_KINDS

    rec = m.adapters
    if not rec:
        names = [k for k in (*m.tensors, *m.aliases)
                 if not _OPTIM_RX.search(k) and not trainer_state(k, m.tensors.get(k))]
        parts = [k.split(".")[:-1] for k in names]
        common: list[str] = []
        if parts:
            for comps in zip(*parts, strict=False):
                if len(set(comps)) != 1:
                    break
                common.append(comps[0])
        excluded = sorted({k for k in m.tensors if _OPTIM_RX.search(k)})
        return [".".join(common)], excluded
    excluded = sorted(p for p, kind in rec.items() if kind in NON_MODEL_KINDS)
    cands: list[str] = []
    for path, kind in rec.items():
        if kind in _MODEL_KINDS:
            sub = _MODEL_KINDS[kind]
            cands.append(f"{path}.{sub}" if path and sub else path or sub)
            if kind == "TorchState":
                excluded.append(f"{path}.optim" if path else "optim")
    plain = []
    for path, kind in rec.items():
        if kind != "tensors" or any(_under(path, e) for e in excluded):
            continue
        if _OPTIM_NAME_RX.match(path.rsplit(".", 1)[-1]):
            excluded.append(path)  # {"optim": {...}} of tensors: optimizer state by its name
        else:
            plain.append(path)
    # a plain mapping that holds another candidate is its container (its own
    # tensors, e.g. a step counter beside it, are not the model)
    cands += [p for p in plain if not any(c != p and _under(c, p) for c in (*cands, *plain))]
    return sorted(set(cands)), sorted(set(excluded))


class AmbiguousModelError(ValueError):
    """The checkpoint holds more than one model subtree (``candidates``), or
    none: pass ``subtree=`` (``--subtree``)."""

    def __init__(self, msg: str, candidates: Sequence[str]):
        super().__init__(msg)
        self.candidates = tuple(candidates)


def _subtree(m: Manifest, subtree: str | None, key: str) -> Manifest:
    """``m`` seen from ``subtree`` (see :func:`export_hf`): its tensors and
    aliases below it, renamed relative to it, without the tensors of
    non-model subtrees inside it (optimizer state, RNG, data cursor)."""
    if subtree == "":  # every tensor, names as saved; trainer state is still not a weight
        return msgspec.structs.replace(
            m, tensors={k: te for k, te in m.tensors.items() if not trainer_state(k, te)},
            aliases={a: t for a, t in m.aliases.items() if not trainer_state(a) and not trainer_state(t)})
    cands, excluded = model_candidates(m)
    if subtree is None:
        if len(cands) != 1:
            shown = ", ".join(repr(c) for c in cands) or "none"
            raise AmbiguousModelError(
                f"export_hf: {key}: cannot tell which subtree is the model (candidates: {shown}); "
                "pass subtree= (--subtree PATH; '' for every tensor, names as saved)", cands)
        sub = cands[0]
    else:
        sub = subtree.rstrip(".")
    drop = [e for e in excluded if e != sub and _under(e, sub)]
    cut = len(sub) + 1 if sub else 0

    def keep(name: str) -> bool:
        return (_under(name, sub) and name != sub and not any(_under(name, e) for e in drop)
                and not trainer_state(name[cut:], m.tensors.get(name)))

    tensors = {k[cut:]: te for k, te in m.tensors.items() if keep(k)}
    if not tensors:
        raise ValueError(f"export_hf: {key}: no tensor under {sub!r} (saved e.g. "
                         f"{sorted(m.tensors)[:3]}; pass subtree='' for every tensor)")
    aliases = {a[cut:]: t[cut:] for a, t in m.aliases.items() if keep(a) and keep(t)}
    # the names the unwrapped model has: a saved ddp.state_dict() (module.), torch.compile's
    # (_orig_mod.), FSDP1's and activation checkpointing's components left out
    try:
        own = unwrapped_names(dict.fromkeys([*tensors, *aliases, *aliases.values()]))
    except ValueError as e:
        raise ValueError(f"export_hf: {key}: under {sub!r}: {e}; pass subtree='' for the names as saved") from None
    tensors = {own[k]: te for k, te in tensors.items()}
    aliases = {own[a]: own[t] for a, t in aliases.items()}
    return msgspec.structs.replace(m, tensors=tensors, aliases=aliases, objects={}, values=None)


def _plan(items: list[_Item], max_shard_bytes: int) -> list[list[_Item]]:
    """Group items (in name order) into shards of at most ``max_shard_bytes``
    tensor bytes; a larger tensor gets a shard of its own."""
    shards: list[list[_Item]] = []
    cur: list[_Item] = []
    size = 0
    for it in items:
        if cur and size + it.nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(it)
        size += it.nbytes
    if cur or not shards:
        shards.append(cur)
    return shards


#: the names transformers reads the weights' dtype from in config.json (``dtype``
#: since transformers 4.56, ``torch_dtype`` before)
_CONFIG_DTYPE_KEYS = ("dtype", "torch_dtype")


def copy_payload(path: str, out_dtype: torch.dtype | None) -> bytes | None:
    """The bytes to write for the copied file ``path``: for a ``config.json``
    when the export casts, the config with ``dtype``/``torch_dtype`` set to
    the export's dtype (each key it has; ``dtype`` and ``torch_dtype`` when
    it has neither), other keys and their order kept; None: copy the file as
    it is.

    Raises:
        ValueError: a config.json that is not a JSON object (named)."""
    if out_dtype is None or os.path.basename(path) != "config.json":
        return None
    with open(path, "rb") as f:
        raw = f.read()
    try:
        cfg = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"export_hf: copy_files: {path}: not JSON ({e}); cannot set its dtype "
                         "to the export's") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"export_hf: copy_files: {path}: a JSON object expected, got {type(cfg).__name__}")
    name = str(out_dtype).removeprefix("torch.")
    keys = [k for k in _CONFIG_DTYPE_KEYS if k in cfg] or list(_CONFIG_DTYPE_KEYS)
    for k in keys:
        cfg[k] = name
    for sub in cfg.values():  # composite models: text_config, vision_config...
        if isinstance(sub, dict):
            for k in _CONFIG_DTYPE_KEYS:
                if isinstance(sub.get(k), str):
                    sub[k] = name
    return (json.dumps(cfg, indent=2, sort_keys=False) + "\n").encode()


def _existing_outputs(out_dir: str) -> list[str]:
    if not os.path.isdir(out_dir):
        return []
    return sorted(n for n in os.listdir(out_dir)
                  if n in (SINGLE_NAME, INDEX_NAME) or _SHARD_RX.match(n))


def export_hf(
    ckpt: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int | str = 2 * 1024**3,
    include: str | Sequence[str] | Callable[[str], bool] | None = None,
    transforms: Sequence[Any] = (),
    copy_files: Sequence[str | os.PathLike[str]] = (),
    include_aliases: bool = False,
    subtree: str | None = None,
    overwrite: bool = False,
    validate: bool = True,
    options: LoadOptions | None = None,
    storage: Storage | None = None,
    progress: bool | None = None,
) -> ExportResult:
    """Write the model tensors of the checkpoint ``ckpt`` (a reshard
    checkpoint, or a PyTorch DCP folder, read as :func:`reshard.load` reads
    it through :func:`~reshard.ondisk.dcp.open_dcp`) as a Hugging Face
    safetensors directory ``out_dir`` (a local path, or an ``s3://`` /
    ``memory://`` prefix: then each shard streams into a multipart upload,
    see :mod:`reshard.formats.hf_store`), one tensor (or one block of at most
    ``READ_BLOCK_BYTES`` of a larger one) in memory at a time. Single
    process: call it on one rank (it uses no process group).

    Args:
        dtype: cast floating-point tensors to this dtype (``torch.bfloat16``
            or ``"bf16"``, ``"fp16"``, ``"fp32"``...); integer and bool
            tensors keep theirs. None: every tensor keeps its saved dtype.
        max_shard_bytes: tensor bytes per shard file at most (an int, or a
            size such as ``"2GB"`` / ``"2GiB"``); a single larger tensor gets a
            shard of its own. Tensors fill shards in output-name order.
        subtree: the tree path of the model to export (``"model"``, ``"ema"``,
            ``"app.model"``); its tensors are written under their names
            relative to it, the model's own parameter names, as Hugging Face
            loaders expect. None (default): the model the manifest records
            (:attr:`~reshard.ondisk.manifest.Manifest.adapters`, see
            :func:`model_candidates`): a ``ModelState``, the ``model`` part of
            a ``TorchState``, a plain mapping of tensors (``model.state_dict()``
            at the root or under a key, the ``"model"`` entry of a
            ``get_state_dict``-style AppState); optimizer state (an
            ``OptimizerState``, TorchState's ``optim``, a mapping shaped as
            ``Optimizer.state_dict()`` or named ``optim``/``optimizer``), RNG
            and data cursor are never model weights, nor is trainer state
            (:func:`trainer_state`: ``train_state.step``, ``lr_scheduler.*``,
            a 0-dim ``step``/``epoch`` counter beside the weights), whatever
            the trainer's layout; in a checkpoint without that record
            (a DCP folder: TorchTitan's flattens the model's keys to the top)
            the model is what remains, under its own names. More than one model
            (``"model"`` and ``"ema"``): :class:`AmbiguousModelError` naming
            them. ``""``: the whole checkpoint, names as saved (trainer state
            left out all the same). ``include``
            and ``transforms`` then see the relative names.
        include: which checkpoint fqns (before transforms) to export: a glob,
            a list of globs, or a predicate. Default: every tensor whose fqn
            does not start with ``"optim."`` (optimizer state, gradients) nor
            names optimizer state (``optimizer.state.*``, TorchTitan's).
            Objects and plain values are never exported.
        transforms: transforms that act on saved names (``Rename``,
            ``Reset``), applied as at load: the output names are the names
            ``reshard.load(..., transforms=...)`` would see.
        copy_files: files copied into ``out_dir`` as they are (config.json,
            tokenizer files...); with ``dtype``, a ``config.json`` is copied
            with its ``dtype``/``torch_dtype`` set to it (:func:`copy_payload`).
        include_aliases: tied weights (``manifest.aliases``) are exported as
            the canonical tensor only, as ``transformers``' ``save_pretrained``
            does for tied embeddings (its loaders re-tie them from the
            config's ``tie_word_embeddings``; safetensors cannot share storage
            between names); the tie is recorded as ``{alias: target}`` under
            ``"tied_weights"`` in the index's ``metadata`` and in every
            shard's ``__metadata__`` (a JSON string), from which
            :func:`~reshard.formats.hf_import.import_hf` restores it. With
            True, each included alias is also written, as a copy under its
            own name (and no tie is recorded).
        overwrite: replace model files already in ``out_dir`` (stale shards of
            an earlier export are removed). Without it, such files are an error.
        validate: re-open each written shard with ``safetensors`` (names,
            dtypes and shapes as its parser reads them) and re-read the bytes
            at each tensor's ``data_offsets``, comparing their xxh3_64 with
            that of the bytes written.
        options: LoadOptions for the reads (checksums on by default, HMAC key).
        storage: a backend for ``ckpt`` instead of resolving its URL. The
            output is written to the local file system.
        progress: a progress bar (bytes written) on stderr; None: only with
            ``RESHARD_PROGRESS=1`` (see :mod:`reshard.progress`).

    Shards are written under temporary names, fsync'd, validated, renamed
    into place; the index is written last. A reader lease on ``ckpt`` is
    held while it is read (retention and gc keep it); with an HMAC key
    (``options.hmac_key``, else the environment's) an unsigned or mis-signed
    checkpoint is refused.

    Raises:
        CheckpointNotFoundError, ManifestError, IntegrityError: as ``load``
            (a DCP folder with an HMAC key given: IntegrityError).
        FileExistsError: model files already in ``out_dir`` (no ``overwrite``).
        AmbiguousModelError: (a ValueError) ``subtree`` None and the
            checkpoint holds no model or more than one (the candidates named).
        ValueError: a bad argument, a transform that is not name-level,
            ``include`` selects nothing.
    """
    from ..commit.leases import reader_lease

    opts = _with_env_key(options)
    st, key = resolve(ckpt, storage)
    key = key.rstrip("/")
    with reader_lease(st, key, what="export", required=opts.require_lease):
        t0 = time.perf_counter()
        out_dtype = None if dtype is None else parse_dtype(dtype)
        limit = parse_size(max_shard_bytes)
        read0 = st.bytes_read
        # a PyTorch DCP folder (no manifest.json, a .metadata) is read as load, inspect and verify
        # read it: through open_dcp's storage and manifest (no record of adapters: see model_candidates)
        rst, saved = _read_or_dcp(st, key, opts)
        sel = _select(saved, key, subtree=subtree, include=include, transforms=transforms,
                      include_aliases=include_aliases, out_dtype=out_dtype)
        job = _Job(st=rst, key=key, m=sel.m, opts=opts, layout=_layout(sel, limit),
                   copies=_checked_copies(copy_files), out_dtype=out_dtype, validate=validate,
                   overwrite=overwrite)
        out_st, out_key = resolve(out_dir)
        _refuse_inside(st, key, out_st, out_key, out_dir)
        if isinstance(out_st, LocalStorage):
            done = _write_local(job, out_key, progress)
        else:
            done = _write_remote(job, out_st, out_key)
        return ExportResult(out_dir=out_st.url(out_key), files=job.layout.files,
                            index_file=job.layout.index_file, weight_map=done.weight_map,
                            total_size=job.layout.total, skipped=tuple(sorted(sel.skipped)),
                            aliases=sel.aliases, copied=done.copied, bytes_read=st.bytes_read - read0,
                            bytes_written=done.bytes_written, duration_s=time.perf_counter() - t0)


# ----------------------------------------------------------------------------- export steps
# export_hf: select (manifest only) -> _Selection; lay out shards -> _Layout; write (local
# files, or a remote store through hf_store) the _Job -> _Written.


def _with_env_key(options: LoadOptions | None) -> LoadOptions:
    """``options`` (default LoadOptions()) with the environment's HMAC key when it names none."""
    from ..options import hmac_key_of

    opts = options or LoadOptions()
    if opts.hmac_key is None or not opts.hmac_key:
        opts = dataclasses.replace(opts, hmac_key=hmac_key_of(opts.hmac_key))
    return opts


@dataclass(frozen=True, kw_only=True)
class _Selection:
    """The tensors an export writes, chosen from the manifest alone.

    Attributes:
        m: the model's manifest (:func:`_subtree`: names relative to the model).
        items: what is written, in output-name order (never empty).
        skipped: checkpoint fqns not exported (see :attr:`ExportResult.skipped`), unsorted.
        aliases: output alias -> output name of its target (:attr:`ExportResult.aliases`).
    """

    m: Manifest
    items: tuple[_Item, ...]
    skipped: tuple[str, ...]
    aliases: dict[str, str]


def _select(saved: Manifest, key: str, *, subtree: str | None, include: Any, transforms: Sequence[Any],
            include_aliases: bool, out_dtype: torch.dtype | None) -> _Selection:
    """The model of ``saved`` (:func:`_subtree`), its tensors that ``include``
    selects under their output names (``transforms``), each cast to
    ``out_dtype`` if floating-point, tied aliases as copies when ``include_aliases``.

    Raises:
        AmbiguousModelError, ValueError: as :func:`export_hf` (nothing selected included).
    """
    m = _subtree(saved, subtree, key)
    keep = _include_fn(include)
    names, alias_names = _output_names(m, transforms)
    kept = set(names.values())
    skipped = [fqn for fqn in m.tensors if not keep(fqn) or fqn not in kept]  # or dropped by Reset

    def item(out: str, saved: str) -> _Item:
        te = m.tensors[saved]
        cast = out_dtype is not None and torch_dtype(te.dtype).is_floating_point
        return _Item(out=out, saved=saved, src_dtype=te.dtype,
                     dtype=dtype_name(out_dtype) if cast else te.dtype,  # type: ignore[arg-type]
                     shape=tuple(te.global_shape))

    items = [item(out, saved) for out, saved in names.items() if keep(saved)]
    out_aliases: dict[str, str] = {}
    for out_alias, (saved_alias, out_target) in alias_names.items():
        if out_target not in names:  # its target was dropped by a transform
            continue
        out_aliases[out_alias] = out_target
        if include_aliases and keep(saved_alias):
            items.append(item(out_alias, names[out_target]))
        else:
            skipped.append(saved_alias)
    if not items:
        raise ValueError(f"export_hf: {key}: no tensor selected (include={include!r}; "
                         f"saved e.g. {sorted(m.tensors)[:3]})")
    items.sort(key=lambda it: it.out)
    return _Selection(m=m, items=tuple(items), skipped=tuple(skipped), aliases=out_aliases)


@dataclass(frozen=True, kw_only=True)
class _Layout:
    """Where the selected tensors go.

    Attributes:
        files: shard file names, in order (``model.safetensors`` alone, or
            ``model-0000i-of-0000N.safetensors``).
        shards: the items of each file (same order; :func:`_plan`).
        total: tensor bytes of all shards (the index's ``total_size``; bytes).
        tied: alias -> target of the tied weights left out (both names
            output names), recorded in every shard header and in the index.
    """

    files: tuple[str, ...]
    shards: tuple[tuple[_Item, ...], ...]
    total: int
    tied: dict[str, str]

    @property
    def index_file(self) -> str | None:
        """``model.safetensors.index.json`` for more than one shard, else None."""
        return INDEX_NAME if len(self.files) > 1 else None

    def index_body(self, weight_map: dict[str, str]) -> bytes | None:
        """The index's bytes for ``weight_map`` (output name -> file), None for one shard."""
        if self.index_file is None:
            return None
        meta: dict[str, Any] = {"total_size": self.total}
        if self.tied:
            meta[TIED_KEY] = dict(sorted(self.tied.items()))
        body = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
        return (json.dumps(body, indent=2) + "\n").encode()


def _layout(sel: _Selection, limit: int) -> _Layout:
    """The shards of ``sel`` at most ``limit`` tensor bytes each (:func:`_plan`), named."""
    shards = _plan(list(sel.items), limit)
    n = len(shards)
    files = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    written_names = {it.out for it in sel.items}
    tied = {a: t for a, t in sel.aliases.items() if a not in written_names and t in written_names}
    return _Layout(files=tuple(files), shards=tuple(tuple(s) for s in shards),
                   total=sum(it.nbytes for it in sel.items), tied=tied)


def _checked_copies(copy_files: Sequence[str | os.PathLike[str]]) -> tuple[str, ...]:
    """``copy_files`` as absolute local paths.

    Raises:
        ValueError: one would replace a model file (its name).
        FileNotFoundError: one is not a file.
    """
    copies = tuple(local_path(c) for c in copy_files)
    for c in copies:
        base = os.path.basename(c)
        if base in (SINGLE_NAME, INDEX_NAME) or _SHARD_RX.match(base):
            raise ValueError(f"export_hf: copy_files: {base!r} would replace a model file")
        if not os.path.isfile(c):
            raise FileNotFoundError(f"export_hf: copy_files: {c} is not a file")
    return copies


def _refuse_inside(st: Storage, key: str, out_st: Storage, out_key: str,
                   out_dir: str | os.PathLike[str]) -> None:
    """Raise ValueError when the output ``out_key`` of ``out_st`` is (inside)
    the checkpoint ``key`` of ``st``: a committed checkpoint is never modified."""
    if not isinstance(out_st, LocalStorage):
        if type(out_st) is type(st) and (out_key == key or out_key.startswith(key.rstrip("/") + "/")):
            raise ValueError(f"export_hf: {out_dir} is inside the checkpoint {key} (a committed "
                             "checkpoint is never modified)")
    elif isinstance(st, LocalStorage):
        rk, ro = os.path.realpath(key), os.path.realpath(out_key)
        if ro == rk or ro.startswith(rk + os.sep):
            raise ValueError(f"export_hf: {out_key} is inside the checkpoint {key} (a committed "
                             "checkpoint is never modified)")


@dataclass(frozen=True, kw_only=True)
class _Job:
    """What the writing step needs.

    Attributes:
        st, key: the storage the tensors are read through (``open_dcp``'s for
            a DCP folder) and the checkpoint's key.
        m: the model's manifest (:attr:`_Selection.m`).
        opts: LoadOptions of the reads.
        layout: the shards to write.
        copies: absolute local paths of the files copied alongside.
        out_dtype: the export's dtype (a copied config.json records it), or None.
        validate, overwrite: as :func:`export_hf`'s.
    """

    st: Storage
    key: str
    m: Manifest
    opts: LoadOptions
    layout: _Layout
    copies: tuple[str, ...]
    out_dtype: torch.dtype | None
    validate: bool
    overwrite: bool


@dataclass(frozen=True, kw_only=True)
class _Written:
    """What the writing step wrote: ``weight_map`` (output name -> file),
    ``copied`` (names of the copied files), ``bytes_written`` (shard bytes,
    headers included)."""

    weight_map: dict[str, str]
    copied: tuple[str, ...]
    bytes_written: int


def _write_remote(job: _Job, out_st: Storage, out_key: str) -> _Written:
    """Write ``job`` under ``out_key`` of a store that is not the local file
    system (:func:`reshard.formats.hf_store.write_shards`)."""
    written, wmap, copied = write_shards(
        job.st, job.key, job.m, out_st, out_key, list(job.layout.files),
        [list(s) for s in job.layout.shards], opts=job.opts, validate=job.validate,
        overwrite=job.overwrite, copies=job.copies, index=job.layout.index_body, tied=job.layout.tied,
        payload=lambda c: copy_payload(c, job.out_dtype))
    return _Written(weight_map=wmap, copied=tuple(copied), bytes_written=written)


def _write_local(job: _Job, out: str, progress: bool | None) -> _Written:
    """Write ``job`` into the local directory ``out``: shards under temporary
    names, renamed into place, stale model files removed, copies, the index
    last, the directory fsync'd. A failure removes the temporary files.

    Raises:
        FileExistsError: model files already in ``out`` and not ``overwrite``.
    """
    stale = _existing_outputs(out)
    if stale and not job.overwrite:
        raise FileExistsError(f"{out}: already holds model files {stale[:3]} (pass overwrite=True)")
    os.makedirs(out, exist_ok=True)
    tmps: list[str] = []  # partial files to remove on a failure
    pb = bar(job.layout.total, "export", enabled=wanted(progress))
    try:
        written, weight_map = _write_local_shards(job, out, tmps, pb)
        for name in stale:
            if name not in job.layout.files:
                os.unlink(os.path.join(out, name))
        copied = _copy_local(job, out, tmps)
        index = job.layout.index_body(weight_map)
        if index is not None:
            _put_file(out, INDEX_NAME, index, tmps)
        _fsync_dir(out)
    finally:
        pb.close()
        for tmp in tmps:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return _Written(weight_map=weight_map, copied=copied, bytes_written=written)


def _write_local_shards(job: _Job, out: str, tmps: list[str], pb: Any) -> tuple[int, dict[str, str]]:
    """Write every shard of ``job`` as ``out/.<file>.partial`` (listed in
    ``tmps`` meanwhile), then rename them all into place. Returns ``(bytes
    written, weight map)``."""
    one = SingleProcess()
    weight_map: dict[str, str] = {}
    written = 0
    for fname, shard in zip(job.layout.files, job.layout.shards, strict=True):
        tmp = os.path.join(out, f".{fname}.partial")
        tmps.append(tmp)
        written += _write_shard(job.st, job.key, job.m, tmp, list(shard), job.opts, one, job.validate, pb,
                                job.layout.tied)
        for it in shard:
            weight_map[it.out] = fname
    for tmp, fname in zip(list(tmps), job.layout.files, strict=True):
        os.replace(tmp, os.path.join(out, fname))
    tmps.clear()
    return written, weight_map


def _copy_local(job: _Job, out: str, tmps: list[str]) -> tuple[str, ...]:
    """Copy ``job.copies`` into ``out`` (a config.json rewritten with the
    export's dtype: :func:`copy_payload`); returns their names."""
    copied = []
    for c in job.copies:
        base = os.path.basename(c)
        dst = os.path.join(out, base)
        payload = copy_payload(c, job.out_dtype)
        if payload is not None:
            _put_file(out, base, payload, tmps)
        elif os.path.abspath(dst) != c:
            shutil.copyfile(c, dst)
            _fsync_file(dst)
        copied.append(base)
    return tuple(copied)


def _put_file(out: str, name: str, data: bytes, tmps: list[str]) -> None:
    """Write ``data`` as ``out/name``: into ``.<name>.partial`` (listed in
    ``tmps`` until renamed), flushed and fsync'd, renamed into place."""
    tmp = os.path.join(out, f".{name}.partial")
    tmps.append(tmp)
    with open(tmp, "wb") as fb:
        fb.write(data)
        fb.flush()
        os.fsync(fb.fileno())
    os.replace(tmp, os.path.join(out, name))
    tmps.remove(tmp)


__all__ = ["AmbiguousModelError", "ExportResult", "copy_payload", "export_hf", "model_candidates",
           "parse_dtype", "parse_size", "trainer_state"]
