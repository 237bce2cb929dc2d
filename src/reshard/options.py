"""Options records for save and load."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# the timeout defaults and their sentinel live on the lowest floor
# (collectives.py reads the sentinel too); their public paths stay here
from .timeouts import DEFAULT_ARRIVAL_TIMEOUT_S as DEFAULT_ARRIVAL_TIMEOUT_S
from .timeouts import DEFAULT_TIMEOUT_S as DEFAULT_TIMEOUT_S
from .timeouts import DefaultSeconds as DefaultSeconds


def check_timeout(v: Any, name: str) -> None:
    """None, or a finite number of seconds > 0.

    Raises:
        ValueError: anything else, naming the option."""
    import math
    import numbers

    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a number of seconds > 0 (or None), got {v!r}")


#: environment variables that give an HMAC key to every entry point (a
#: caller's ``SaveOptions``/``LoadOptions(hmac_key=...)`` wins over them):
#: the key's text itself, or the path of a file holding it
HMAC_KEY_ENV = "RESHARD_HMAC_KEY"
HMAC_KEY_FILE_ENV = "RESHARD_HMAC_KEY_FILE"
#: ``hmac_key=NO_HMAC_KEY``: no key, whatever the environment says (a
#: converter reading a foreign checkpoint, which carries no signature)
NO_HMAC_KEY = b""


def read_key_file(path: str) -> bytes:
    """The HMAC key held by the file ``path``: its bytes without trailing
    whitespace (a newline an editor added), at most 4 KiB; only a regular
    file is read (a FIFO is refused, never waited on).

    Raises:
        ValueError: the file is missing, unreadable, not a regular file, empty or too large.
    """
    import os

    from .storage.local import open_regular

    try:
        fd = open_regular(os.path.expanduser(path), os.O_RDONLY)
    except Exception as e:  # noqa: BLE001 - one message, whatever went wrong
        raise ValueError(f"HMAC key file {path!r}: {getattr(e, 'strerror', None) or e}") from None
    try:
        raw = os.read(fd, 4097)
    finally:
        os.close(fd)
    key = raw.rstrip()
    if not key or len(raw) > 4096:
        raise ValueError(f"HMAC key file {path!r}: {'empty' if not key else 'more than 4 KiB'}")
    return key


def env_hmac_key() -> bytes | None:
    """The key the environment gives (``RESHARD_HMAC_KEY_FILE``: a file
    holding it, else ``RESHARD_HMAC_KEY``: its text, UTF-8), or None.

    Raises:
        ValueError: ``RESHARD_HMAC_KEY_FILE`` names a file that cannot be read."""
    import os

    path = os.environ.get(HMAC_KEY_FILE_ENV)
    if path:
        return read_key_file(path)
    text = os.environ.get(HMAC_KEY_ENV)
    return text.encode() if text else None


def hmac_key_of(given: bytes | None) -> bytes | None:
    """The key an entry point uses: ``given`` when set (``NO_HMAC_KEY``: none
    at all), else the environment's (:func:`env_hmac_key`)."""
    if given is not None:
        return given or None
    return env_hmac_key()


#: SaveOptions' fields by concern: group name -> (its record's fields, in order).
#: The flat fields stay SaveOptions' own (``dataclasses.replace``, ``asdict``
#: and ``==`` work as before); each group is a read-only view and a way to
#: build one (:meth:`SaveOptions.of`).
SAVE_OPTION_GROUPS: dict[str, tuple[str, ...]] = {
    "integrity": ("checksums", "checksum_block_bytes", "hmac_key", "verify_replicas"),
    "files": ("files_per_rank", "durable", "overwrite"),
    "record": ("schema_version", "mesh", "extra"),
    "lineage": ("parent", "lineage", "incremental", "own_file_bytes"),
    "background": ("max_pending", "if_busy", "background_nice", "staging_threads",
                   "staging_budget_bytes", "overlap_staging"),
    "timeouts": ("timeout_s", "arrival_timeout_s"),
    "display": ("progress",),
}


@dataclass(frozen=True, kw_only=True)
class IntegrityOptions:
    """What a save records to check its bytes: see :class:`SaveOptions`
    (``checksums``, ``checksum_block_bytes``, ``hmac_key``, ``verify_replicas``)."""

    checksums: bool = True
    checksum_block_bytes: int = 1 << 20
    hmac_key: bytes | None = None
    verify_replicas: bool = True


@dataclass(frozen=True, kw_only=True)
class FileOptions:
    """How a save writes its files: see :class:`SaveOptions` (``files_per_rank``,
    ``durable``, ``overwrite``)."""

    files_per_rank: int = 1
    durable: bool = True
    overwrite: bool = False


@dataclass(frozen=True, kw_only=True)
class RecordOptions:
    """What the manifest records beside the state: see :class:`SaveOptions`
    (``schema_version``, ``mesh``, ``extra``)."""

    schema_version: str | None = None
    mesh: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class LineageOptions:
    """Where a checkpoint comes from and what it shares with it: see
    :class:`SaveOptions` (``parent``, ``lineage``, ``incremental``, ``own_file_bytes``)."""

    parent: str | None = None
    lineage: str | None = None
    incremental: bool | None = None
    own_file_bytes: int = 1 << 20


@dataclass(frozen=True, kw_only=True)
class BackgroundOptions:
    """How an asynchronous save stages and runs: see :class:`SaveOptions`
    (``max_pending``, ``if_busy``, ``background_nice``, ``staging_threads``,
    ``staging_budget_bytes``, ``overlap_staging``)."""

    max_pending: int = 1
    if_busy: str = "block"
    background_nice: int = 10
    staging_threads: int | None = None
    staging_budget_bytes: int | None = None
    overlap_staging: bool = False


@dataclass(frozen=True, kw_only=True)
class TimeoutOptions:
    """How long a save's collectives wait: see :class:`SaveOptions`
    (``timeout_s``, ``arrival_timeout_s``; seconds)."""

    timeout_s: float | None = DEFAULT_TIMEOUT_S
    arrival_timeout_s: float | None = DEFAULT_ARRIVAL_TIMEOUT_S


@dataclass(frozen=True, kw_only=True)
class DisplayOptions:
    """What a save shows: see :class:`SaveOptions` (``progress``)."""

    progress: bool | None = None


_GROUP_TYPES: dict[str, type] = {
    "integrity": IntegrityOptions, "files": FileOptions, "record": RecordOptions,
    "lineage": LineageOptions, "background": BackgroundOptions, "timeouts": TimeoutOptions,
    "display": DisplayOptions,
}


@dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """How a save runs.

    Attributes:
        checksums: record an xxh3_64 checksum per block of every chunk.
        checksum_block_bytes: block size of chunk checksums, in bytes; a reader
            verifies whole blocks, so a ranged read reads at most one block
            more on each side than it needs.
        files_per_rank: data files each writer spreads its bytes over, one
            writer thread per file.
        overwrite: replace a committed checkpoint at ``path`` (local file
            system only; the new one is published before the old is retired).
        durable: fsync files and directories before publishing.
        schema_version: the user's model/training schema version, recorded in
            the manifest and checked at load.
        mesh: a description of the save-time device mesh, recorded as is
            (JSON-safe dict, e.g. ``{"dp": 2, "tp": 2}``).
        extra: free-form JSON-safe metadata recorded in the manifest (the
            key ``"manifest_xxh3_64"`` is reserved for the manifest's own
            checksum: ValueError).
        hmac_key: when set, the manifest carries an HMAC-SHA256 over its
            contents; a load given the same key refuses a manifest that fails it.
            None (default): the key of the environment (``RESHARD_HMAC_KEY_FILE``
            or ``RESHARD_HMAC_KEY``), if any; ``NO_HMAC_KEY``: none.
        verify_replicas: compare checksums of every replica of every chunk
            across ranks (a mismatch is a ShardingError). Plain tensors and
            common values are always compared.
        max_pending: asynchronous saves in flight at most (async_save).
        if_busy: what a further async_save does at ``max_pending``: "block"
            until the oldest commits, or "skip" it with a warning.
        background_nice: how much lower the priority of an async save's
            background thread (and of the writer threads it starts) is than
            the caller's: added to its nice value (Linux, per thread; capped
            at 19; 0 keeps the caller's). The training step then keeps the
            CPU it competes for with the writer and hasher.
        progress: a progress bar on stderr for rank 0's writes (bytes); None:
            only when the environment variable ``RESHARD_PROGRESS=1``.
        parent: recorded as the manifest's ``parent``: the name of the
            checkpoint (a sibling under the same root) this state continues
            from. A plain ``save`` records exactly what is given (default
            None: no parent); ``CheckpointManager`` passes the checkpoint it
            resumed from, then its previous save.
        lineage: recorded as the manifest's ``lineage``: the id of the root's
            ``HEAD`` record the saving run continues from (set by
            ``CheckpointManager``; leave None otherwise).
        timeout_s: seconds every collective of the save may wait for the
            other ranks, independently of the training group's timeout: the
            save's collectives then run on a checkpoint process group (gloo)
            created once with this timeout (every rank of ``group`` must
            save with the same value; the group is made once per group and
            value, and again after a failure made it unusable). A rank that
            does not arrive fails the save on every other rank with a
            CheckpointError naming it and the phase; a rank lost while the
            others wait (killed: its connections close) fails it within
            seconds. While a collective waits longer than 30 s, the
            coordinator logs one line per 30 s naming the ranks that have
            not arrived and the phase. Default :data:`DEFAULT_TIMEOUT_S`
            (600 s, or the group's own timeout when that is shorter); None:
            the group's own timeout (the background group of ``async_save``
            takes the training group's).
        arrival_timeout_s: seconds every rank waits, before the save's first
            collective (and before its checkpoint group is created), for
            the other ranks of ``group`` to call the save too (a check-in
            through the job's store: :func:`reshard.collectives.arrive`); a
            rank that does not call it (a plug-in point run on rank 0 only)
            fails the save on the ranks that did, with a CheckpointError
            naming the absent ranks and the phase "arrival". Capped at
            ``timeout_s``. Default :data:`DEFAULT_ARRIVAL_TIMEOUT_S` (60 s);
            None: no check (the first collective waits up to ``timeout_s``).
        staging_threads: threads that copy CPU tensors into the staging
            buffers during ``async_save``'s stall (tensors of at least 1 MiB,
            in slices of 16 MiB; smaller ones and the state walk stay on the
            caller's thread, overlapping the copies). None (default): as many
            as the CPUs this process may run on, at most 4; 1: every copy on
            the caller's thread. The threads live as long as the process
            group's saver and run nothing after the stall (in the overlap
            mode they copy after ``async_save`` returned, until ``staged``).
        staging_budget_bytes: host memory (bytes, per rank, pinned memory
            included) that an asynchronous save may stage into: the staging
            slabs of one process group's saves never exceed it, whatever
            the state's size. A state larger than the budget is staged in
            pieces in write order, each piece written (and its slab reused)
            while later pieces are staged; a tensor larger than a slab is
            staged in slices. The slabs are kept for the next save
            (``reshard.prewarm_staging`` allocates them ahead of time).
            Memory beyond the budget (the stated constant): the block
            digests a file keeps until it is written (about 80 bytes per
            MiB of the rank's state), the encoded plain values and objects,
            and the write path's own buffers (none on a local disk; the
            multipart parts in flight on S3): within 64 MiB on a local disk
            for up to 500 GB of tensors per rank. None (default): a
            quarter of the node's memory (its physical memory, or its
            cgroup's limit when lower) divided among its local ranks
            (``LOCAL_WORLD_SIZE``, else ``SLURM_NTASKS_PER_NODE``, else 1),
            logged once (``reshard.saving.staging``, INFO); never a reading
            of free memory. At least 64 KiB. When the state is larger than
            the budget, the default mode's stall includes writing all but
            the last budget's worth of it.
        overlap_staging: the overlap mode. ``async_save`` returns once it
            has walked the state (the adapters' state dicts, the plain
            values encoded), before every tensor is copied;
            ``handle.staged`` completes later (CPU and CUDA tensors alike)
            while the loop runs its next forward and backward. The loop
            must call :func:`reshard.wait_for_staging` (or
            ``CheckpointManager.wait_for_staging()``) before it next
            mutates the state (before ``optimizer.step()``): that call is
            the guarantee. Behind it, a guard: every staged tensor's
            version counter and data pointer are compared when its copy
            completes; a tensor changed before it was staged fails that
            save (a CheckpointError naming it, on every rank, nothing
            published). The guard cannot see writes through ``.data``,
            fused optimizer kernels that do not bump version counters
            (``torch.optim.AdamW(fused=True)``), or kernels writing through
            raw pointers. Default False: ``async_save`` returns once every
            CPU byte is staged.
        incremental: write once the bytes a save shares with its parent
            (``parent``): every tensor chunk of at least ``own_file_bytes``
            gets a data file of its own, and such a file is linked from the
            parent checkpoint instead of written when the chunk's xxh3_128
            (computed from the staged copy, in the background for an
            asynchronous save) equals the parent's (a hard link on a local
            file system, a copy inside the store on S3, where the store then
            holds the bytes again). Every checkpoint stays self-contained
            (docs/design.md, "Incremental checkpoints"). None (default): on
            for the saves of a ``CheckpointManager``, off for a plain
            ``save``; True: on (a plain ``save`` then links from the
            ``parent`` it names; without one it only groups its files so
            that the next save can link); False: off. The first save after
            a change of the chunk boxes (a TP, PP or FSDP resize; a DP
            resize keeps them) is written in full.
        own_file_bytes: the smallest chunk, in bytes, that gets a file of
            its own in an incremental save (smaller chunks share the
            writer's files and are written every time).
    """

    checksums: bool = True
    checksum_block_bytes: int = 1 << 20
    files_per_rank: int = 1
    overwrite: bool = False
    durable: bool = True
    schema_version: str | None = None
    mesh: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    hmac_key: bytes | None = None
    verify_replicas: bool = True
    max_pending: int = 1
    if_busy: str = "block"
    background_nice: int = 10
    progress: bool | None = None
    parent: str | None = None
    lineage: str | None = None
    timeout_s: float | None = DEFAULT_TIMEOUT_S
    staging_threads: int | None = None
    staging_budget_bytes: int | None = None
    overlap_staging: bool = False
    arrival_timeout_s: float | None = DEFAULT_ARRIVAL_TIMEOUT_S
    incremental: bool | None = None
    own_file_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        check_timeout(self.timeout_s, "SaveOptions.timeout_s")
        check_timeout(self.arrival_timeout_s, "SaveOptions.arrival_timeout_s")
        b = self.staging_budget_bytes
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < (64 << 10)):
            raise ValueError(f"SaveOptions.staging_budget_bytes must be an int of at least 65536 "
                             f"bytes (64 KiB), or None for the default, got {b!r}")
        if not isinstance(self.overlap_staging, bool):
            raise ValueError(f"SaveOptions.overlap_staging must be True or False, got {self.overlap_staging!r}")
        if self.incremental not in (None, True, False):
            raise ValueError(f"SaveOptions.incremental must be None, True or False, got {self.incremental!r}")
        if isinstance(self.own_file_bytes, bool) or not isinstance(self.own_file_bytes, int) \
                or self.own_file_bytes < 1:
            raise ValueError(f"SaveOptions.own_file_bytes must be an int >= 1 (bytes), got {self.own_file_bytes!r}")
        t = self.staging_threads
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise ValueError(f"SaveOptions.staging_threads must be an int >= 1 (or None), got {t!r}")
        if self.max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        if not 0 <= self.background_nice <= 19:
            raise ValueError(f"background_nice must be from 0 to 19, got {self.background_nice}")
        if self.if_busy not in ("block", "skip"):
            raise ValueError("if_busy must be 'block' or 'skip'")
        if self.checksum_block_bytes <= 0:
            raise ValueError("checksum_block_bytes must be positive")
        if self.files_per_rank < 1:
            raise ValueError("files_per_rank must be >= 1")
        from .ondisk.manifest import SEAL_KEY

        if SEAL_KEY in self.extra:
            raise ValueError(f"extra[{SEAL_KEY!r}] is reserved for the manifest's own checksum "
                             "(it would be replaced when the manifest is written); use another key")

    # -- the same fields by concern (SAVE_OPTION_GROUPS)
    @classmethod
    def of(cls, *, integrity: IntegrityOptions | None = None, files: FileOptions | None = None,
           record: RecordOptions | None = None, lineage_options: LineageOptions | None = None,
           background: BackgroundOptions | None = None, timeouts: TimeoutOptions | None = None,
           display: DisplayOptions | None = None, **flat: Any) -> SaveOptions:
        """SaveOptions from its groups (and any flat field besides), e.g.
        ``SaveOptions.of(integrity=IntegrityOptions(checksums=False),
        background=BackgroundOptions(overlap_staging=True))``.

        Raises:
            TypeError: a flat field also given by its group, or an unknown name.
            ValueError: what the flat constructor raises for a bad value."""
        kw: dict[str, Any] = {}
        given = {"integrity": integrity, "files": files, "record": record, "lineage": lineage_options,
                 "background": background, "timeouts": timeouts, "display": display}
        for name, grp in given.items():
            if grp is None:
                continue
            if not isinstance(grp, _GROUP_TYPES[name]):
                arg = "lineage_options" if name == "lineage" else name
                raise TypeError(f"SaveOptions.of({arg}=...) takes a {_GROUP_TYPES[name].__name__}, "
                                f"got {type(grp).__name__}")
            for f in SAVE_OPTION_GROUPS[name]:
                if f in flat:
                    raise TypeError(f"SaveOptions.of: {f!r} given both flat and in its group ({name})")
                kw[f] = getattr(grp, f)
        return cls(**kw, **flat)

    def _group(self, name: str) -> Any:
        return _GROUP_TYPES[name](**{f: getattr(self, f) for f in SAVE_OPTION_GROUPS[name]})

    @property
    def integrity(self) -> IntegrityOptions:
        """``checksums``, ``checksum_block_bytes``, ``hmac_key``, ``verify_replicas``."""
        return self._group("integrity")

    @property
    def files(self) -> FileOptions:
        """``files_per_rank``, ``durable``, ``overwrite``."""
        return self._group("files")

    @property
    def record(self) -> RecordOptions:
        """``schema_version``, ``mesh``, ``extra``."""
        return self._group("record")

    @property
    def lineage_options(self) -> LineageOptions:
        """``parent``, ``lineage``, ``incremental``, ``own_file_bytes`` (``lineage``
        is a flat field's name: the group is ``lineage_options``)."""
        return self._group("lineage")

    @property
    def background(self) -> BackgroundOptions:
        """``max_pending``, ``if_busy``, ``background_nice``, ``staging_threads``,
        ``staging_budget_bytes``, ``overlap_staging``."""
        return self._group("background")

    @property
    def timeouts(self) -> TimeoutOptions:
        """``timeout_s``, ``arrival_timeout_s``."""
        return self._group("timeouts")

    @property
    def display(self) -> DisplayOptions:
        """``progress``."""
        return self._group("display")


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How a load runs.

    Attributes:
        checksums: verify the checksum of every block read (default on; the
            "never a wrong tensor" guarantee holds only with it on).
        threads: reader threads per rank.
        direct_read_min_bytes: chunks at least this large (bytes) are read
            straight into their destination when its layout allows; smaller
            neighbouring reads are coalesced into one.
        schema_version: the schema the caller expects; a checkpoint recorded
            with another one raises unless a transform migrates it.
        hmac_key: verify the manifest's HMAC with this key (refuse unsigned).
            None (default): the key of the environment (``RESHARD_HMAC_KEY_FILE``
            or ``RESHARD_HMAC_KEY``), if any; ``NO_HMAC_KEY``: none.
        limits: the size limits of what the load parses, checked before
            parsing (:class:`~reshard.ondisk.limits.ReadLimits`: manifest,
            names, free-form fields, safetensors headers, DCP metadata,
            encoded values); None: the defaults (or ``RESHARD_LIMIT_*``).
        require_lease: refuse to load when the reader lease on the
            checkpoint cannot be written (a read-only mount, read-only
            credentials, a full disk); by default the load warns once and
            reads unprotected (retention may then delete it under the load).
        unchecked: what a load does with chunks it reads that carry no
            checksum (saved with ``checksums=False``, or a manifest edited to
            drop them): "warn" (default: one warning naming the checkpoint),
            "refuse" (IntegrityError before any target is written) or
            "accept". Without an HMAC key this is honesty, not security: who
            can edit a manifest can also drop its digests.
        progress: a progress bar on stderr for rank 0's reads; None: only when
            the environment variable ``RESHARD_PROGRESS=1``.
        verify_first: before any target is written, read every block the
            load needs once and verify its checksum (into one bounded scratch
            buffer of 4 MiB per reader thread), then read again to load. A
            bit-rot checksum error then leaves every target untouched on every
            rank (without it, such an error is found while targets are being
            written, and the error names the written ones). Cost: every
            needed byte is read and hashed twice: measured 1.4-1.5x the time
            (median) of a default load of 256 MiB of float32 from a warm page
            cache, 1 or 4 reader threads, 2 CPUs
            (``benchmarks/bench_verify_first.py``); where storage bandwidth
            dominates, expect up to 2x (not measured). Extra memory: the
            scratch buffers only. Needs ``checksums``; a needed chunk saved
            without checksums is refused (IntegrityError).
        read_once: a chunk range that several ranks of the group need is
            read from storage by one of them and sent to the others (point
            to point over the load's group); off: every rank reads all it
            needs itself. ``"auto"`` (default): on where storage is remote
            (an object store, or a local path on a network file system:
            NFS, CIFS/SMB, Lustre, GPFS, BeeGFS, CephFS, a FUSE mount; see
            :func:`reshard.loading.reading.read_once_wanted`), off on a local disk,
            whose page cache serves a rank faster than a transfer from
            another rank does (measured on real gloo ranks with a warm page
            cache: handing the replicas over took 1.1-1.7x the time of every
            rank reading its own, ``benchmarks/bench_read_once.py``). On
            only when every rank asks for it. Costs one
            gather and one scatter of 32 bytes per needed range (to and from
            the coordinator) and one all-reduce; memory: a range whose
            destination is not one contiguous region (or that the sender read
            with neighbours) travels through a buffer of its size.
        read_once_min_bytes: ranges smaller than this (bytes) are read by
            every rank that needs them: reading them costs less than waiting
            for another rank to hand them over (measured on 16 and 32 gloo
            processes sharing 2 CPUs, a page-cache-warm state of KiB-sized
            ranges, ``benchmarks/bench_real_ranks.py``, best of 3: handing
            every range over took 1.1-1.3x the time of each rank reading its
            own). 0: every shared range is read once.

        timeout_s: seconds every collective of the load may wait for the
            other ranks (a checkpoint process group with this timeout, as
            ``SaveOptions.timeout_s``; the error and the progress lines name
            the load's phase: manifest, plan, read, load_state_dict).
            Default :data:`DEFAULT_TIMEOUT_S` (600 s, or the group's own
            timeout when shorter); None: the group's own timeout.
        arrival_timeout_s: seconds every rank waits, before the load's first
            collective, for the other ranks of ``group`` to call the load
            too (as ``SaveOptions.arrival_timeout_s``). Default
            :data:`DEFAULT_ARRIVAL_TIMEOUT_S` (60 s); None: no check.

    Raises:
        ValueError: ``verify_first`` without ``checksums``, ``threads < 1``,
            or a ``timeout_s`` or ``arrival_timeout_s`` that is not a
            positive number.
    """

    checksums: bool = True
    threads: int = 4
    direct_read_min_bytes: int = 1 << 20
    schema_version: str | None = None
    hmac_key: bytes | None = None
    progress: bool | None = None
    verify_first: bool = False
    timeout_s: float | None = DEFAULT_TIMEOUT_S
    read_once: bool | str = "auto"
    read_once_min_bytes: int = 64 << 10
    arrival_timeout_s: float | None = DEFAULT_ARRIVAL_TIMEOUT_S
    limits: Any = None
    require_lease: bool = False
    unchecked: str = "warn"

    def __post_init__(self) -> None:
        check_timeout(self.timeout_s, "LoadOptions.timeout_s")
        check_timeout(self.arrival_timeout_s, "LoadOptions.arrival_timeout_s")
        if self.unchecked not in ("warn", "refuse", "accept"):
            raise ValueError(f"LoadOptions.unchecked must be 'warn', 'refuse' or 'accept', "
                             f"got {self.unchecked!r}")
        from .ondisk.limits import ReadLimits

        if self.limits is not None and not isinstance(self.limits, ReadLimits):
            raise ValueError(f"LoadOptions.limits must be a ReadLimits (or None), got {self.limits!r}")
        if self.read_once not in (True, False, "auto"):
            raise ValueError(f"LoadOptions.read_once must be True, False or 'auto', got {self.read_once!r}")
        if self.read_once_min_bytes < 0:
            raise ValueError("read_once_min_bytes must be >= 0")
        if self.verify_first and not self.checksums:
            raise ValueError("verify_first needs checksums=True (it verifies checksums)")
        if self.threads < 1:
            raise ValueError("threads must be >= 1")
