"""Where the files live: the ``Store`` seam, a local directory, an S3-compatible object store."""
