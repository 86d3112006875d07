# SPDX-License-Identifier: BSD-3-Clause
"""The `slurm_cluster` fixture: one real local Slurm cluster per test session (see cluster.sh).

Tests that use it are marked `@pytest.mark.slurm` (the marker is registered in pyproject.toml).
They are skipped, with the reason, where the cluster cannot run: not root, or no Slurm/apt-get.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # `import harness`, whatever pytest's import mode
import harness  # noqa: E402


@pytest.fixture(scope="session")
def slurm_cluster():
    """The harness module, with the cluster up; stopped at the end of the session."""
    ok, reason = harness.available()
    if not ok:
        pytest.skip(reason)
    harness.start()
    yield harness
    harness.stop()
