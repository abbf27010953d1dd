"""Writing: :class:`~rollfeed.payload.write.writer.PayloadWriter` encodes a request's fields into
regions and hands the bytes to a sink, which writes them (:mod:`.file_sink`: ``pwritev`` into a
local file; :mod:`.object_writer`: PUTs of whole objects to an S3-compatible store)."""
