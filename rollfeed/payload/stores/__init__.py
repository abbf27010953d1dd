"""Where the files live: the ``Store`` seam, a local directory (leases of open descriptors, opens
held beneath the root) and an S3-compatible object store (its leases, prune, the obstore client
and its runtime across ``fork``, the requests botocore signs, their answers, deadlines and
errors, and the ``s3://`` URL)."""
