"""``inspect`` and ``verify`` of an object-store root: the local scan, object by object.

Each ``*.rfp`` object under the prefix is fetched whole (``verify`` reads every byte anyway) into
a private temporary directory under its handle, scanned there by
:func:`~rollfeed.payload.scan.scan.scan_file` (the same header, region chain, CSR index and checksum
checks as a local root), and deleted before the next one, so the disk holds one object at a time.
An object that cannot be fetched (deleted meanwhile, refused credential) is a refused entry named
by its handle. Endpoint and credentials come from the ``AWS_*`` variables.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from rollfeed.payload.errors import PayloadError
from rollfeed.payload.scan.scan import SUFFIX, FileScan, RootScan, scan_file
from rollfeed.payload.stores.object_errors import store_error
from rollfeed.payload.stores.object_root import ObjectRoot


def scan_store(url: str, *, checksums: bool = True, **access: Any) -> RootScan:
    """Scan every ``*.rfp`` object under ``url`` (``s3://bucket/prefix``)."""
    import obstore

    root = ObjectRoot(url, **access)
    store = root._proc().store
    prefix = f"{root.url.prefix}/" if root.url.prefix else ""
    metas = []
    try:
        for batch in obstore.list(store, prefix=prefix or None, chunk_size=1000):
            metas += [m for m in batch if m["path"].endswith(SUFFIX)]
    except Exception as raw:
        raise store_error(raw, where=url, rel=".", what="listing") from None
    scans: list[FileScan] = []
    refused: list[PayloadError] = []
    with tempfile.TemporaryDirectory(prefix="rollfeed-scan-") as tmp:
        for meta in sorted(metas, key=lambda m: m["path"]):
            rel = root.url.rel(meta["path"])
            local = os.path.join(tmp, rel)
            try:
                data = bytes(obstore.get(store, meta["path"]).bytes())
            except Exception as raw:
                refused.append(store_error(raw, where=root.where(rel), rel=rel, what="GET"))
                continue
            os.makedirs(os.path.dirname(local), exist_ok=True)
            with open(local, "wb") as f:
                f.write(data)
            try:
                scan = scan_file(tmp, rel, checksums=checksums)
            except PayloadError as err:
                refused.append(err)
                continue
            finally:
                os.unlink(local)
            mtime = meta["last_modified"].timestamp()
            scans.append(
                FileScan(
                    file=rel,
                    size=scan.size,
                    mtime=mtime,
                    regions=scan.regions,
                    problem=scan.problem,
                )
            )
    root.close()
    return RootScan(root=url, scans=scans, refused=refused)
