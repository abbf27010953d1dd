"""rollfeed.loaders."""
