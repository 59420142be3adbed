"""Pickers: one admitted engine from the summed cost (one small module per picker)."""

from switchyard.solver.routing.pickers.first_min import FirstMin
from switchyard.solver.routing.pickers.least_cost import LeastCost
from switchyard.solver.routing.pickers.power_of_two import PowerOfTwo
from switchyard.solver.routing.pickers.random_pick import RandomPick
from switchyard.solver.routing.pickers.round_robin import RoundRobin
from switchyard.solver.routing.pickers.softmax import SoftmaxSample

__all__ = ["FirstMin", "LeastCost", "PowerOfTwo", "RandomPick", "RoundRobin", "SoftmaxSample"]
