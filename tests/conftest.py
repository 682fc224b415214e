import os

from hypothesis import settings

# CI runs on 2 cores: keep property tests small and free of wall-clock deadlines.
settings.register_profile("ci", max_examples=40, deadline=None)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
