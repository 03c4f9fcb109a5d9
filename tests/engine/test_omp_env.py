"""conveyor's OpenMP wait policy: applied when the user set none, never over theirs.

Each case runs a fresh interpreter with OMP_DISPLAY_ENV=VERBOSE, so torch's libgomp itself
prints the spin count it took when it loaded: the check is what OpenMP runs with, not only
what os.environ holds.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conveyor.omp_env import DEFAULT_OMP_ENV, apply_omp_wait_default

pytestmark = pytest.mark.slow  # a fresh interpreter loading torch per case

_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# What conveyor's environment left, then libgomp's own report on stderr.
_SCRIPT = """
import json, os, sys
{imports}
import torch
torch.ones(4).sum()
print(json.dumps({{k: os.environ.get(k) for k in {knobs!r}}}))
"""


def _run(user_env: dict[str, str], imports: str = "import conveyor") -> tuple[dict, list[str]]:
    """(the knobs in the child's os.environ, libgomp's GOMP_SPINCOUNT per libgomp start)."""
    env = {k: v for k, v in os.environ.items() if k not in _KNOBS}
    env |= {**user_env, "OMP_DISPLAY_ENV": "VERBOSE"}
    script = _SCRIPT.format(imports=imports, knobs=_KNOBS)
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1]), re.findall(
        r"GOMP_SPINCOUNT = '(\d+)'", proc.stderr
    )


def test_the_default_is_applied_before_torch_loads_when_the_user_set_nothing() -> None:
    knobs, spincounts = _run({})
    assert knobs == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "10000"}
    assert spincounts == ["10000"]  # libgomp's own default: 300000


@pytest.mark.parametrize(
    ("user_env", "spincount"),
    [
        ({"OMP_WAIT_POLICY": "ACTIVE"}, "30000000000"),
        ({"GOMP_SPINCOUNT": "300000"}, "300000"),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, "0"),
        ({"GOMP_SPINCOUNT": "50", "OMP_WAIT_POLICY": "PASSIVE"}, "50"),
    ],
)
def test_a_users_choice_is_never_overridden(user_env: dict[str, str], spincount: str) -> None:
    knobs, spincounts = _run(user_env)
    assert knobs == {k: user_env.get(k) for k in _KNOBS}  # nothing added, nothing changed
    assert spincounts == [spincount]


def test_torch_imported_first_keeps_libgomps_default_but_child_processes_get_ours() -> None:
    # The engine process, tensor-parallel workers and replicas inherit the environment, and
    # import conveyor before torch in any case.
    child = "import subprocess; subprocess.run([sys.executable, '-c', 'import torch'], check=True)"
    knobs, spincounts = _run({}, imports=f"import torch\nimport conveyor\n{child}")
    assert knobs == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "10000"}
    assert spincounts == ["300000", "10000"]  # this process (too late), then its child


def test_apply_omp_wait_default_on_a_mapping() -> None:
    env: dict[str, str] = {}
    assert apply_omp_wait_default(env) and env == DEFAULT_OMP_ENV
    for user in ({"OMP_WAIT_POLICY": ""}, {"GOMP_SPINCOUNT": "5"}):
        env = dict(user)
        assert not apply_omp_wait_default(env) and env == user
