"""The OpenMP wait policy conveyor runs with unless the user chose one.

torch's CPU kernels (and ours in model/cpu/csrc, built with -fopenmp into torch's libgomp pool)
run in OpenMP parallel regions. Between regions libgomp's idle threads spin, by default
300000 times (a few ms) before they sleep. A decode step is hundreds of short regions, so on
a machine whose cores other processes also want, the spinning threads burn the time slices
the working thread needs. PASSIVE (sleep at once) costs a wake-up per region on a quiet
machine; a short spin, GOMP_SPINCOUNT=10000, keeps quiet-machine speed and gives the cores
back when other jobs want them (benchmarks/omp_wait.py; docs/kernels.md#measured-choices).

libgomp reads the variables once, when it loads (with `import torch`), so this runs when the
`conveyor` package is imported: before torch if the user's script imports conveyor first,
and always before torch in the processes conveyor starts (the CLI, engine processes,
tensor-parallel workers and data-parallel replicas inherit the environment). A script that
imports torch before conveyor keeps libgomp's own default in its own process (its engine
processes still get ours); set OMP_WAIT_POLICY in the environment there. A value the user set
for either variable, even an empty one, is never changed.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# Set only when neither variable is in the environment (a user who set either chose already).
DEFAULT_OMP_ENV = {"GOMP_SPINCOUNT": "10000"}
_USER_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def apply_omp_wait_default(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Put DEFAULT_OMP_ENV into `environ` unless the user set OMP_WAIT_POLICY or
    GOMP_SPINCOUNT; whether it did."""
    if any(name in environ for name in _USER_KNOBS):
        return False
    environ.update(DEFAULT_OMP_ENV)
    return True
