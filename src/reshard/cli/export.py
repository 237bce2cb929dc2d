"""``reshard export / convert / diff``: a checkpoint out to Hugging Face safetensors, in from
DCP or Hugging Face, and the logical comparison of two checkpoints (registered on the root
group in :mod:`reshard.cli`).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import click

from ..errors import CheckpointError, CheckpointNotFoundError
from ..storage import resolve
from .support import (
    CHECK_FAILED,
    USAGE,
    _fail,
    _progress,
    hmac_option,
    human_bytes,
    json_option,
    table,
    write_json,
)


@click.command("export")
@click.argument("ckpt")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--format", "fmt", type=click.Choice(["hf"]), default="hf", show_default=True,
              help="Output format: hf = Hugging Face safetensors directory.")
@click.option("--dtype", default=None, help="Cast floating-point tensors (bf16, fp16, fp32).")
@click.option("--max-shard-size", default="2GiB", show_default=True,
              help="Tensor bytes per shard file at most (2GB = 2e9 as in Hugging Face, 2GiB = 2**31).")
@click.option("--copy", "copies", multiple=True, metavar="FILE",
              help="A file to copy alongside (config.json, tokenizer files); repeatable.")
@click.option("--include", "includes", multiple=True,
              help="Glob over fqns (relative to --subtree) to export (repeatable; default: every model "
                   "tensor: optimizer state under any optim/optimizer name, RNG, data and trainer "
                   "state are left out).")
@click.option("--subtree", default=None, metavar="PATH",
              help="Tree path of the model to export, written under its own parameter names "
                   "(default: the model the checkpoint records: a ModelState, TorchState's model, "
                   "a saved model.state_dict(); exit 2 naming the candidates when it holds several; "
                   "'' = every name as saved).")
@click.option("--overwrite", is_flag=True, help="Replace model files already in OUT.")
@hmac_option
@json_option
def export_cmd(ckpt: str, out: str, fmt: str, dtype: str | None, max_shard_size: str,
               copies: tuple[str, ...], includes: tuple[str, ...], subtree: str | None,
               overwrite: bool, json_path: str | None) -> None:
    """Export the model tensors of checkpoint CKPT (or a DCP folder) to the directory OUT
    (streaming, one tensor in memory at a time) under the model's own
    parameter names; optimizer, RNG and data state and objects are never
    written. With --dtype, a copied config.json names the new dtype."""
    from ..formats.hf_export import export_hf, parse_dtype, parse_size

    try:
        limit = parse_size(max_shard_size)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--max-shard-size") from None
    try:
        cast = None if dtype is None else parse_dtype(dtype)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--dtype") from None
    try:
        res = export_hf(ckpt, out, dtype=cast, max_shard_bytes=limit, copy_files=copies,
                        include=list(includes) or None, subtree=subtree, overwrite=overwrite,
                        progress=_progress())
    except CheckpointNotFoundError as e:
        _fail(USAGE, str(e))
    except FileExistsError as e:
        _fail(USAGE, str(e).replace("(pass overwrite=True)", "(pass --overwrite to replace them)"))
    except FileNotFoundError as e:  # a --copy file
        _fail(USAGE, str(e))
    except CheckpointError as e:
        _fail(USAGE, f"{type(e).__name__}: {e}")
    except ValueError as e:  # a bad argument (a ShardingError is a CheckpointError, above)
        _fail(USAGE, str(e))
    mb = res.total_size / 1e6 / max(res.duration_s, 1e-9)
    write_json(json_path, {"out_dir": res.out_dir, "files": list(res.files), "index": res.index_file,
                           "tensors": len(res.weight_map), "total_bytes": res.total_size,
                           "bytes_read": res.bytes_read, "bytes_written": res.bytes_written,
                           "seconds": res.duration_s, "mb_per_s": mb, "skipped": list(res.skipped)})
    click.echo(f"exported {len(res.weight_map)} tensors ({human_bytes(res.total_size)}) to "
               f"{res.out_dir} in {len(res.files)} file{'' if len(res.files) == 1 else 's'}, "
               f"{res.duration_s:.2f} s, {mb:.1f} MB/s")
    for f in (*res.files, *((res.index_file,) if res.index_file else ()), *res.copied):
        click.echo(f"  {f}")
    if res.skipped:
        click.echo(f"  skipped {len(res.skipped)} (optimizer state, tied aliases, excluded): "
                   + ", ".join(res.skipped[:5]) + (" ..." if len(res.skipped) > 5 else ""))


@click.command("convert")
@click.option("--from", "src_format", type=click.Choice(["dcp", "hf"]), required=True,
              help="Format of SRC: dcp = a torch.distributed.checkpoint directory; hf = a Hugging "
                   "Face safetensors directory (model.safetensors or an index over shards).")
@click.argument("src")
@click.argument("dst")
@click.option("--step", type=int, default=None, help="Step to record in the new manifest.")
@click.option("--overwrite", is_flag=True, help="Replace a committed checkpoint at DST.")
@click.option("--skip-unsafe-values", is_flag=True,
              help="dcp: leave out values that cannot be decoded with weights_only (default: refuse SRC).")
@hmac_option
@json_option
def convert_cmd(src_format: str, src: str, dst: str, step: int | None, overwrite: bool,
                skip_unsafe_values: bool, json_path: str | None) -> None:
    """Convert the checkpoint SRC (another format) into a committed reshard
    checkpoint DST; nothing of SRC is unpickled except through restricted
    unpicklers. dcp streams chunk by chunk; hf (an import of Hugging Face
    weights) holds the model in memory once.

    Exits 2 if there is no checkpoint at SRC, SRC is refused or unreadable, or
    DST already holds a checkpoint (without --overwrite). A reader lease is
    held on SRC while it is read; with an HMAC key (--hmac-key-file or the
    environment's) DST is signed with it.
    """
    from ..commit.protocol import check_target
    from ..options import SaveOptions

    t0 = time.perf_counter()
    try:
        dst_st, dst_key = resolve(dst)
        check_target(dst_st, dst_key, overwrite=overwrite)
    except FileExistsError as e:
        _fail(USAGE, str(e).replace("(pass SaveOptions(overwrite=True) to replace it)",
                                    "(pass --overwrite to replace it)"))
    except (CheckpointError, ValueError) as e:
        _fail(USAGE, str(e))
    opts = SaveOptions(overwrite=overwrite, progress=_progress())
    try:
        if src_format == "dcp":
            from ..formats.dcp_convert import convert_dcp

            res = convert_dcp(src, dst, step=step, options=opts, skip_unsafe_values=skip_unsafe_values)
        else:
            res = _convert_hf(src, dst, step, opts)
    except CheckpointError as e:
        msg = str(e).replace("pass skip_unsafe_values=True", "pass --skip-unsafe-values")  # the CLI's flag
        _fail(USAGE, msg if isinstance(e, CheckpointNotFoundError) else f"{type(e).__name__}: {msg}")
    except ValueError as e:  # unsupported URL scheme
        _fail(USAGE, str(e))
    m = res.manifest
    assert m is not None
    secs = time.perf_counter() - t0
    write_json(json_path, {"src": src, "format": src_format, "path": res.path, "tensors": len(m.tensors),
                           "values": len(m.values or {}), "total_bytes": res.total_bytes,
                           "files": res.num_files, "seconds": secs})
    click.echo(f"converted {src} ({src_format}) -> {res.path}: {len(m.tensors)} tensors, "
               f"{len(m.values or {})} values, {human_bytes(res.total_bytes)} in {res.num_files} "
               f"file{'' if res.num_files == 1 else 's'}, {secs:.2f} s")
    skipped = m.extra.get("dcp_skipped_values") or {}
    if skipped:
        click.echo(f"  skipped {len(skipped)} value(s) that cannot be decoded safely:")
        for k, why in skipped.items():
            click.echo(f"    {k}: {why}")


def _convert_hf(src: str, dst: str, step: int | None, opts: Any) -> Any:
    """A Hugging Face directory as a committed reshard checkpoint (one process)."""
    import torch

    from ..collectives import SingleProcess
    from ..formats.hf_import import hf_manifest, import_hf
    from ..saving.save import save
    from ..state.sharding import ShardedTensor, torch_dtype

    _, _, m = hf_manifest(src)
    state: dict[str, Any] = {}
    for i, (fqn, te) in enumerate(m.tensors.items()):
        state[f"t{i:09d}"] = ShardedTensor(fqn, torch.empty(tuple(te.global_shape), dtype=torch_dtype(te.dtype)),
                                           global_shape=tuple(te.global_shape),
                                           global_offset=(0,) * len(te.global_shape))
    # the ties hf_manifest found (an export's record, or config.json's tie_word_embeddings for a
    # save_pretrained directory): each alias is requested as its target's own memory, so the load
    # fills it and the save records the tie (manifest.aliases) as a model with tied weights would
    by_fqn = {st.fqn: st for st in state.values()}
    for i, (alias, target) in enumerate(m.aliases.items()):
        t = by_fqn[target]
        state[f"~tied{i:09d}"] = ShardedTensor(alias, t.data, global_shape=t.global_shape,
                                               global_offset=t.global_offset)
    from ..commit.leases import reader_lease
    from ..options import NO_HMAC_KEY, LoadOptions

    src_st, src_key = resolve(src)
    with reader_lease(src_st, src_key, what="convert"):  # a foreign directory: it carries no HMAC
        import_hf(state, src_key, group=SingleProcess(), storage=src_st,
                  options=LoadOptions(progress=opts.progress, hmac_key=NO_HMAC_KEY))
    return save(state, dst, step=step, group=SingleProcess(), options=opts)


@click.command("diff")
@click.argument("a")
@click.argument("b")
@hmac_option
@json_option
def diff_cmd(a: str, b: str, json_path: str | None) -> None:
    """Compare checkpoints A and B (reshard checkpoints or DCP folders) by
    logical content, whatever their layouts: keys added and removed (grouped
    by subtree with counts; --json lists them all), shape/dtype changes, which
    tensors' values differ (by chunk digest first, then by reading both: the
    maximum absolute difference), and which values and objects differ (by
    decoded content: a per-rank grid of equal elements is one value).

    Exits 0 if they hold the same state, 1 if they differ, 2 if either cannot
    be read.
    """
    from ..catalog.diff import by_subtree, diff

    try:
        r = diff(a, b)
    except CheckpointNotFoundError as e:
        _fail(USAGE, str(e))
    except (CheckpointError, ValueError) as e:
        _fail(USAGE, f"{type(e).__name__}: {e}")
    write_json(json_path, r.to_json())
    click.echo(f"a: {r.a}")
    click.echo(f"b: {r.b}")
    for title, keys in (("added in b", r.added), ("removed in b", r.removed)):
        if keys:  # by subtree with counts (--json lists every key)
            click.echo(f"{title} ({len(keys)}):")
            for head, n in by_subtree(keys).items():
                one = [k for k in keys if k == head or k.startswith(head + ".")]
                click.echo(f"  {one[0]}" if n == 1 else f"  {head}.* ({n} keys)")
    if r.changed:
        click.echo(f"shape/dtype changed ({len(r.changed)}):")
        for k, what in r.changed.items():
            click.echo(f"  {k}: {what}")
    if r.differ:
        click.echo(f"values differ ({len(r.differ)}):")
        table(["key", "max |a-b|"], [[k, f"{v:.6g}"] for k, v in r.differ.items()], right=(1,))
    if r.unreadable:
        click.echo(f"not compared ({len(r.unreadable)}, unreadable):")
        for k, why in r.unreadable.items():
            click.echo(f"  {k}: {why}")
    if r.values_differ:
        click.echo(f"values/objects differ ({len(r.values_differ)}): " + ", ".join(r.values_differ))
    click.echo(f"same: {r.same_by_digest + r.same_by_value} tensors ({r.same_by_digest} by chunk "
               f"digest, {r.same_by_value} by value)")
    click.echo("IDENTICAL" if r.identical else "DIFFERENT")
    if not r.identical:
        sys.exit(CHECK_FAILED)


@click.command("copy")
@click.argument("src")
@click.argument("dst")
@click.option("--hmac-key-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A file holding the HMAC key of a signed SRC: its signature is checked and the "
                   "copy signed with it (a signed SRC without it is refused).")
@click.option("--overwrite", is_flag=True,
              help="Replace a checkpoint already at DST (local file system only).")
def copy_cmd(src: str, dst: str, hmac_key_file: str | None, overwrite: bool) -> None:
    """Copy the checkpoint SRC to DST (a path or URL: another root, another
    store) as a checkpoint of its own: every byte is checked against its
    checksum while it is copied, the copy is published manifest-last (a
    copy that fails leaves no checkpoint at DST) and holds its own bytes.
    Exits 1 if a byte of SRC does not match its checksum (nothing is
    published), 2 if SRC is not a checkpoint or DST is taken."""
    from ..catalog.copy import copy_checkpoint
    from ..errors import IntegrityError

    key = None
    if hmac_key_file is not None:
        with open(hmac_key_file, "rb") as f:
            key = f.read().strip()
    t0 = time.perf_counter()
    try:
        m = copy_checkpoint(src, dst, hmac_key=key, overwrite=overwrite)
    except (CheckpointNotFoundError, FileExistsError, ValueError) as e:
        _fail(USAGE, str(e))
    except IntegrityError as e:
        _fail(CHECK_FAILED, f"{type(e).__name__}: {e}")
    except CheckpointError as e:
        _fail(USAGE, f"{type(e).__name__}: {e}")
    click.echo(f"copied {src} to {dst}: {len(m.files)} file(s), {human_bytes(m.total_bytes)} checked "
               f"and written ({time.perf_counter() - t0:.2f} s)")
