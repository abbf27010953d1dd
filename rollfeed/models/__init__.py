"""rollfeed.models."""
