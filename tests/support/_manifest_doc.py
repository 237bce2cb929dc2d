"""Writing a manifest document by hand, as a writer would (sealed over its
own bytes by the rule of its format version): tests that edit a manifest to reach the validator's checks (an
attacker can recompute the seal; it guards against accidental change, the
HMAC against deliberate change). What the seal itself refuses is tested in
test_manifest_seal.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from reshard.ondisk.manifest import SEAL_FEATURE, SEAL_KEY, SEALED_BY_HEAD, reseal


def sealed_json(doc: dict[str, Any]) -> bytes:
    version = doc.get("format_version")
    if SEAL_KEY in doc or (isinstance(version, int) and version >= SEALED_BY_HEAD):
        # version 3 on: the seal is the first member of the object
        return reseal(json.dumps({SEAL_KEY: "", **{k: v for k, v in doc.items() if k != SEAL_KEY}}).encode())
    extra = doc.get("extra")
    if isinstance(extra, dict):
        doc = {**doc, "extra": {**extra, SEAL_KEY: "0" * 16}}
        feats = [f for f in doc.get("required_features", []) if f != SEAL_FEATURE]
        doc["required_features"] = [*feats, SEAL_FEATURE]
        return reseal(json.dumps(doc).encode())
    return json.dumps(doc).encode()


def write_manifest_doc(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` to ``path`` (a manifest.json), sealed."""
    path.write_bytes(sealed_json(doc))
