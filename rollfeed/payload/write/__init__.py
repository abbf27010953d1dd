"""The writer (encodes) and its sinks (write): a local file by ``pwritev``, or object PUTs."""
