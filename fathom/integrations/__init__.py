"""Fathom inside other libraries' decoding loops: :mod:`fathom.integrations.transformers` (``FathomCache``)."""
