"""The offline scan: every file under a root (local or object store) parsed and held to its own
claims, with its checksums verified (``rollfeed scan``)."""
