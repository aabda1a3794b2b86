"""placeholder, filled by the generator work."""
