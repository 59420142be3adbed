"""Filters: which engines may take the request (one small module per filter; see `solver.routing.framework`)."""

from switchyard.solver.routing.filters.alive import Alive
from switchyard.solver.routing.filters.domain import DomainPartition
from switchyard.solver.routing.filters.kv_first import KvFirst
from switchyard.solver.routing.filters.tau_band import TauBand

__all__ = ["Alive", "DomainPartition", "KvFirst", "TauBand"]
