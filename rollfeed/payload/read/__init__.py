"""Reading: :func:`~rollfeed.payload.read.reader.read_fields` checks the records (:mod:`.checks`,
:mod:`.regions`: every record and header rule), plans the byte ranges (:mod:`.read_plan`) and reads
them, fixed-width (:mod:`.fixed_read`) or ragged (:mod:`.ragged_index`, :mod:`.ragged_read`), or in
one compiled pass (:mod:`.compiled_read` and its C kernel ``_window.c``)."""
