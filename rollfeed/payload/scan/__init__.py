"""``inspect`` and ``verify``: every file of any store walked region by region."""
