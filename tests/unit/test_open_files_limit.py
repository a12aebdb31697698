"""The router raises its soft open-files limit to the hard one at start (issue 39)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

from tests.util import ROOT

_CODE = """
import resource
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from router.cli import raise_open_files_limit
import json
print(json.dumps([raise_open_files_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)]))
"""


def test_the_soft_limit_goes_up_to_the_hard_one() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    out = subprocess.run([sys.executable, "-c", _CODE], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=True).stdout.strip()
    (before, after, reported_hard), now = json.loads(out)
    assert before == 256 and reported_hard == hard
    expected = hard if hard != resource.RLIM_INFINITY else 1 << 20
    assert after == expected and now[0] == expected
