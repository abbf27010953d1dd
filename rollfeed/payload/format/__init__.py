"""The byte format alone: file and region headers, the ragged index, checksums, value encodings and
the canonical label rows. Nothing here opens a file; the writer, the reads and the scan all speak
through it (:mod:`.layout` is the one description of the bytes on disk)."""
