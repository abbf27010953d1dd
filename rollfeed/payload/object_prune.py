"""Pruning a group of an object-store root: its objects, and its incomplete multipart uploads.

A writer killed while uploading a large object in parts leaves an incomplete multipart upload:
invisible to readers (no object exists until the upload completes) but stored, and billed. So
``prune(group)`` deletes every object whose key lies under ``<prefix>/<group>/`` and aborts every
multipart upload started under it (``ListMultipartUploads`` / ``AbortMultipartUpload``, signed by
:mod:`rollfeed.payload.object_sign`, since the object client does not offer them).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from rollfeed.payload.errors import PayloadMissingFileError
from rollfeed.payload.object_errors import store_error
from rollfeed.payload.object_sign import store_request, xml_answer

if TYPE_CHECKING:
    from rollfeed.payload.object_root import ObjectRoot

log = logging.getLogger(__name__)


def incomplete_uploads(root: ObjectRoot, prefix: str) -> list[tuple[str, str]]:
    """``(key, upload id)`` of every incomplete multipart upload under key ``prefix``."""
    what, query = "listing uploads", {"uploads": "", "prefix": prefix}
    body = store_request(
        root.access, root.url.bucket, "", "GET", what=what, where=root.path, query=query
    )
    ns = {"s3": "http://s3.amazonaws.com/doc/2006-03-01/"}
    tree = xml_answer(body, what=what, where=root.path, rel=prefix)
    out = []
    for up in tree.findall("s3:Upload", ns) or tree.findall("Upload"):
        key = up.findtext("s3:Key", None, ns) or up.findtext("Key")
        upload = up.findtext("s3:UploadId", None, ns) or up.findtext("UploadId")
        if key and upload and key.startswith(prefix):
            out.append((key, upload))
    return out


def prune_group(root: ObjectRoot, group: str) -> None:
    """Delete group ``group``'s objects and abort its uploads (see the module doc)."""
    import obstore

    prefix = root.url.key(group) + "/"
    proc = root._proc()
    keys: list[str] = []
    try:
        for batch in obstore.list(proc.store, prefix=prefix, chunk_size=1000):
            keys += [meta["path"] for meta in batch]
        if keys:
            obstore.delete(proc.store, keys)
    except Exception as raw:
        raise store_error(raw, where=root.where(group), rel=group, what="pruning") from None
    uploads = incomplete_uploads(root, prefix)
    for key, upload in uploads:
        where, query = f"s3://{root.url.bucket}/{key}", {"uploadId": upload}
        store_request(
            root.access,
            root.url.bucket,
            key,
            "DELETE",
            what="aborting an upload",
            where=where,
            query=query,
        )
    if not keys and not uploads:
        raise PayloadMissingFileError(
            f"payload group not found under {root.path}; nothing to prune", file=group
        )
    log.info("pruned %s: %d objects, %d incomplete uploads", group, len(keys), len(uploads))
