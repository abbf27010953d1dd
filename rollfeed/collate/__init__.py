"""rollfeed.collate."""
