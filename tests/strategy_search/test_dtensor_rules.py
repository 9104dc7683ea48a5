"""shardfn's rules in DTensor's form go into DTensor's registry when shardfn first plans, not when it is imported
(their truth: tests/strategy_search/test_rule_truth.py)."""

import subprocess
import sys


def test_importing_shardfn_leaves_dtensors_registry_as_it_is():
    code = ("import shardfn\n"
            "from shardfn.strategy_search import dtensor_rules\n"
            "from shardfn.strategy_search.registry import REGISTRY\n"
            "assert dtensor_rules.REGISTERED == [] and REGISTRY.dtensor_pending()\n"
            "dtensor_rules.register()\n"
            "assert not REGISTRY.dtensor_pending()\n"
            "print(len(dtensor_rules.REGISTERED))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
