"""Stage 2: CapturedGraph + constraints -> Plan."""

from .cost_model import CPU, H100, DeviceProfile, profile_for
from .plan import Collective, Cost, InputPlan, NodePlan, Plan
from .search import InputRequest, OutputRequest, PlanRequest, make_plan

__all__ = [
    "CPU",
    "H100",
    "DeviceProfile",
    "profile_for",
    "Collective", "Cost", "InputPlan", "InputRequest", "NodePlan", "OutputRequest", "Plan", "PlanRequest",
    "make_plan"]
