"""Pruning a group of an object-store root: its objects, and its incomplete multipart uploads.

A writer killed while uploading a large object in parts leaves an incomplete multipart upload:
invisible to readers (no object exists until the upload completes) but stored, and billed. So
``prune(group)`` deletes every object whose key lies under ``<prefix>/<group>/`` and aborts every
multipart upload started under it (``ListMultipartUploads``, every page of it, and
``AbortMultipartUpload``, several in flight: requests signed by botocore,
:mod:`~rollfeed.payload.stores.object_botocore`, since obstore does not offer them).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from rollfeed.payload.errors import PayloadIOError, PayloadMissingFileError

if TYPE_CHECKING:
    from rollfeed.payload.stores.object_botocore import SignedRequests
    from rollfeed.payload.stores.object_root import ObjectRoot

log = logging.getLogger(__name__)
UPLOADS_PAGE = 1000  # uploads asked for per page of the listing (S3's own page size)
_NS = {"s3": "http://s3.amazonaws.com/doc/2006-03-01/"}
_MARKERS = (("NextKeyMarker", "key-marker"), ("NextUploadIdMarker", "upload-id-marker"))


def _text(node, name: str) -> str | None:
    return node.findtext(f"s3:{name}", None, _NS) or node.findtext(name)


def incomplete_uploads(root: ObjectRoot, prefix: str) -> list[tuple[str, str]]:
    """``(key, upload id)`` of every incomplete multipart upload under key ``prefix``, over
    every page of the listing: the next page starts at the markers the store names
    (``NextKeyMarker``, ``NextUploadIdMarker``: S3 names both, SeaweedFS the upload id only);
    a listing that says it is truncated but names neither, or names the same again, is a
    :class:`PayloadIOError` (uploads would be left behind)."""
    what = "listing uploads"
    signed = root._proc().client.signed()
    out: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    markers: dict[str, str] = {}
    while True:
        query = {"uploads": "", "prefix": prefix, "max-uploads": str(UPLOADS_PAGE), **markers}
        tree = signed.xml("GET", "", what=what, where=root.path, query=query)
        for up in tree.findall("s3:Upload", _NS) or tree.findall("Upload"):
            key, upload = _text(up, "Key"), _text(up, "UploadId")
            if key and upload and key.startswith(prefix) and (key, upload) not in seen:
                seen.add((key, upload))
                out.append((key, upload))
        if _text(tree, "IsTruncated") != "true":
            return out
        nxt = {param: v for name, param in _MARKERS if (v := _text(tree, name))}
        if not nxt or nxt == markers:
            raise PayloadIOError(
                f"{what} of {root.path}: the store says its answer is truncated but names no "
                f"next page (markers {nxt or 'none'}); its remaining uploads cannot be listed",
                file=prefix,
            )
        markers = nxt


def prune_group(root: ObjectRoot, group: str) -> None:
    """Delete group ``group``'s objects and abort its uploads (see the module doc)."""
    prefix = root.url.key(group) + "/"
    proc = root._proc()
    signed = proc.client.signed()  # before deleting: no credential for them, nothing deleted
    where = root.where(group)
    keys = [m["path"] for m in proc.client.keys(prefix, where=where, rel=group)]
    if keys:
        proc.client.delete(keys, where=where, rel=group)
    uploads = incomplete_uploads(root, prefix)
    if uploads:
        proc.map(lambda key, up: _abort(signed, root, key, up), *zip(*uploads, strict=True))
    if not keys and not uploads:
        raise PayloadMissingFileError(
            f"payload group not found under {root.path}; nothing to prune", file=group
        )
    log.info("pruned %s: %d objects, %d incomplete uploads", group, len(keys), len(uploads))


def _abort(signed: SignedRequests, root: ObjectRoot, key: str, upload: str) -> None:
    """Abort one upload; one gone meanwhile (completed, or aborted by a retry or another prune)
    is what aborting it wanted."""
    try:
        signed.request(
            "DELETE",
            key,
            what="aborting an upload",
            where=f"s3://{root.url.bucket}/{key}",
            query={"uploadId": upload},
        )
    except PayloadMissingFileError:
        log.debug("upload %s of %s was gone already", upload, key)
