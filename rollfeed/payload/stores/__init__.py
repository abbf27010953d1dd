"""Where the files live: local files (leases of open descriptors, opens held beneath the root) and
S3-compatible object stores (the object root and its leases, prune, the obstore client, the
requests botocore signs, their answers, deadlines and errors, and the ``s3://`` URL)."""
