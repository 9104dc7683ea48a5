"""Stage 2: CapturedGraph + constraints -> Plan."""

from .cost_model import CPU, H100, DeviceProfile, profile_for
from .plan import Collective, Cost, NodePlan, Plan
from .search import Constraints, make_plan

__all__ = [
    "CPU",
    "H100",
    "DeviceProfile",
    "profile_for",
    "Collective", "Constraints", "Cost", "NodePlan", "Plan", "make_plan"]
