"""Deployment material: NATS and PostgreSQL configuration, manifests. Files only: no module of the package imports
from here (the schema migrations live beside the models, in `switchyard.shared.db`'s `migrations/`)."""
