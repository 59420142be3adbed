"""Switchyard's shared layer: the wire contract (schemas, codec, subjects), settings, bus and database helpers.

Every service imports this package; nothing in it knows about any particular service.
"""
