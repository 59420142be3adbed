"""The migration service."""
