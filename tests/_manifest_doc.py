"""Writing a manifest document by hand, as a writer would (sealed over its
own bytes): tests that edit a manifest to reach the validator's checks (an
attacker can recompute the seal; it guards against accidental change, the
HMAC against deliberate change). What the seal itself refuses is tested in
test_manifest_seal.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from reshard.ondisk.manifest import SEAL_FEATURE, SEAL_KEY, reseal


def sealed_json(doc: dict[str, Any]) -> bytes:
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
