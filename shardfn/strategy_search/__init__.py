"""Stage 2: CapturedGraph + PlanRequest -> Plan."""

# shardfn's own rules and checks, and its rules in DTensor's form, registered with the one registry (registry)
from . import dtensor_rules, expert_rules, rules  # noqa: F401
from .cost_model import CPU, H100, DeviceProfile, profile_for
from .plan import Collective, Cost, InputPlan, NodePlan, Plan
from .rules import head_cut
from .request import InputRequest, OutputRequest, PlanRequest
from .search import make_plan

__all__ = [
    "CPU",
    "H100",
    "DeviceProfile",
    "profile_for",
    "Collective", "Cost", "InputPlan", "NodePlan", "OutputRequest", "Plan", "PlanRequest", "InputRequest",
    "head_cut",
    "make_plan"]
