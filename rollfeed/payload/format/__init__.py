"""The byte format only: headers, the ragged index, checksums, value encodings, label rows."""
