"""Deployment material: Alembic migrations (`alembic/`), NATS and PostgreSQL configuration, manifests."""
