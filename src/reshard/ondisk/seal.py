"""The manifest's own checksum (its seal), on bytes: the rule of format
version 3, and the rule of version 2 kept to read (and reseal) the manifests
written under it.

Version 3: the manifest's bytes begin with the 39 bytes
``{"manifest_xxh3_64":"<16 hex digits>",`` (:data:`SEAL_HEAD`, the digest,
``",``) and the digest is the xxh3_64 of every byte after them, the rest of
the JSON object as written. The seal is found at a fixed place and checked
over the bytes read, never over a re-encoding, so a field this reader does
not know is covered too; a JSON reader sees one more top-level key.

Version 2: ``extra["manifest_xxh3_64"]`` holds the xxh3_64 of the bytes as
written with that value read as 16 zeros, wherever the key stands and
whatever JSON whitespace surrounds its colon (found by a regular expression),
and ``required_features`` names ``manifest-seal``.
"""

from __future__ import annotations

import re

import msgspec
import xxhash

#: the seal's key: in version 3 the first key of the manifest object, in
#: version 2 a key of its ``extra``
SEAL_KEY = "manifest_xxh3_64"
#: ``required_features`` entry of a version-2 manifest that carries its seal
#: in ``extra``: a reader must check it, and one that cannot refuses it
SEAL_FEATURE = "manifest-seal"
#: the first bytes of a version-3 manifest; the seal's 16 hex digits and
#: ``",`` follow, then the rest of the object, which the seal covers
SEAL_HEAD = b'{"' + SEAL_KEY.encode() + b'":"'
#: where the sealed bytes of a version-3 manifest start
SEALED_FROM = len(SEAL_HEAD) + 16 + 2
_SEAL_ZERO = "0" * 16
_ENCODER = msgspec.json.Encoder()
_WS = b" \t\n\r"


def seal(body: bytes) -> bytes:
    """A version-3 manifest: :data:`SEAL_HEAD`, the xxh3_64 of ``body`` and
    ``",``, then ``body`` (a JSON object's members and its closing brace,
    what follows its opening brace)."""
    return SEAL_HEAD + xxhash.xxh3_64_hexdigest(body).encode() + b'",' + body


def head_seal(raw: bytes) -> str | None:
    """The seal written in the head of version-3 ``raw``; None when ``raw``
    does not begin with :data:`SEAL_HEAD`."""
    if not raw.startswith(SEAL_HEAD):
        return None
    return raw[len(SEAL_HEAD):SEALED_FROM - 2].decode("ascii", "replace")


def head_seal_matches(raw: bytes) -> bool:
    """Whether version-3 ``raw`` (beginning with :data:`SEAL_HEAD`) holds in
    its head the xxh3_64 of every byte after the head."""
    return (raw[SEALED_FROM - 2:SEALED_FROM] == b'",'
            and xxhash.xxh3_64_hexdigest(memoryview(raw)[SEALED_FROM:]).encode()
            == raw[len(SEAL_HEAD):SEALED_FROM - 2])


def _skip_ws(raw: bytes, i: int) -> int:
    while i < len(raw) and raw[i] in _WS:
        i += 1
    return i


def _body_after_seal_key(raw: bytes) -> bytes | None:
    """What follows the first member of the JSON object ``raw`` when that
    member is the seal's key with a string value (any JSON whitespace around
    it, as ``json.dumps`` of a version-3 document writes it): the object's
    other members and its closing brace; None otherwise."""
    key = _ENCODER.encode(SEAL_KEY)
    i = _skip_ws(raw, 0)
    if raw[i:i + 1] != b"{":
        return None
    i = _skip_ws(raw, i + 1)
    if raw[i:i + len(key)] != key:
        return None
    i = _skip_ws(raw, i + len(key))
    if raw[i:i + 1] != b":":
        return None
    i = _skip_ws(raw, i + 1)
    end = raw.find(b'"', i + 1) if raw[i:i + 1] == b'"' else -1
    if end < 0 or b"\\" in raw[i:end]:
        return None
    i = _skip_ws(raw, end + 1)
    return raw[i + 1:] if raw[i:i + 1] == b"," else None


def reseal(raw: bytes) -> bytes:
    """``raw``, the JSON bytes of a manifest document, sealed over its own
    bytes: for tools and tests that write a manifest document themselves. A
    version-3 document has the seal's key (any string value) as the first
    member of its object (``{"manifest_xxh3_64": "", **doc}``): it comes
    back with the canonical head and the rest of its bytes as they are. A
    version-2 document holds ``extra["manifest_xxh3_64"]`` once (any string
    value) and names ``manifest-seal``: sealed by the version-2 rule.

    Raises:
        ValueError: neither (the key is not the first member, nor in the
            bytes exactly once).
    """
    body = _body_after_seal_key(raw)
    if body is not None:
        return seal(body)
    spans = _seal_spans(raw)
    if len(spans) != 1:
        raise ValueError(f"{SEAL_KEY!r} must be the first key of a version-3 manifest document, or "
                         f"appear once in a version-2 one (in its extra); found {len(spans)} times")
    zeroed = _with_value(raw, spans[0], _SEAL_ZERO)
    return _with_value(zeroed, _seal_spans(zeroed)[0], xxhash.xxh3_64_hexdigest(zeroed))


# --------------------------------------------------------------------------- version 2


def seal_token(digest: str) -> bytes:
    """The key and value as a version-2 writer writes them in ``extra``."""
    return _ENCODER.encode(SEAL_KEY) + b":" + _ENCODER.encode(digest)


def placeholder() -> bytes:
    """The version-2 seal before its value is known (16 zeros)."""
    return seal_token(_SEAL_ZERO)


#: the version-2 seal's key and its string value (group 1), with whatever
#: JSON whitespace a writer put around the colon
_SEAL_RE = re.compile(rb'"' + re.escape(SEAL_KEY.encode()) + rb'"[ \t\n\r]*:[ \t\n\r]*("[^"\\]*")')


def _seal_spans(raw: bytes, value: str | None = None) -> list[re.Match[bytes]]:
    """The occurrences of the key in ``raw`` (with ``value`` only, when given)."""
    want = None if value is None else _ENCODER.encode(value)
    return [mt for mt in _SEAL_RE.finditer(raw) if want is None or mt.group(1) == want]


def _with_value(raw: bytes, at: re.Match[bytes], value: str) -> bytes:
    return raw[:at.start(1)] + _ENCODER.encode(value) + raw[at.end(1):]


def v2_seal_matches(raw: bytes, got: str) -> bool:
    """Whether version-2 ``raw`` holds the seal ``got`` exactly once and it
    is the xxh3_64 of ``raw`` with that value read as 16 zeros."""
    spans = _seal_spans(raw, got)
    if len(spans) != 1:
        return False
    return xxhash.xxh3_64_hexdigest(_with_value(raw, spans[0], _SEAL_ZERO)) == got
