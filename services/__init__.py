"""Switchyard's services (router, placement, migration, api) and the `switchyard` command line."""
