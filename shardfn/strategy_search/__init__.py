"""Stage 2: CapturedGraph + PlanRequest -> Plan."""

from . import expert_rules, rules  # noqa: F401 - shardfn's own rules and checks, registered with the candidates
from .cost_model import CPU, H100, DeviceProfile, profile_for
from .plan import Collective, Cost, InputPlan, NodePlan, Plan
from .request import InputRequest, OutputRequest, PlanRequest
from .search import make_plan

__all__ = [
    "CPU",
    "H100",
    "DeviceProfile",
    "profile_for",
    "Collective", "Cost", "InputPlan", "NodePlan", "OutputRequest", "Plan", "PlanRequest", "InputRequest",
    "make_plan"]
