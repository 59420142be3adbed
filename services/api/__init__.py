"""The api service."""
