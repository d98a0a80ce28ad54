"""A pytest plugin that ``gpubroker bench array-api --no-shrink`` loads into the conformance suite's run.

The suite loads its own hypothesis profile ("array-api-tests": max examples, deadline) when pytest configures;
this plugin configures after it and loads a child profile without the shrink and explain phases. A failing test
then reports the example that found it instead of spending hundreds more examples (each a device round trip) on a
minimal one: what passes and what fails is the same, only the failures' examples are not minimal.
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings

PROFILE = "array-api-tests-no-shrink"


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    settings.register_profile(PROFILE, parent=settings(), phases=[Phase.explicit, Phase.reuse, Phase.generate])
    settings.load_profile(PROFILE)
