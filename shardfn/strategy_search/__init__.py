"""Stage 2: CapturedGraph + constraints -> Plan."""

from .plan import Collective, Cost, NodePlan, Plan
from .search import Constraints, make_plan

__all__ = ["Collective", "Constraints", "Cost", "NodePlan", "Plan", "make_plan"]
