"""Reads: the record and header checks, the read plan, fixed and ragged reads, the compiled pass."""
