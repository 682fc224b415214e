"""Benchmarks of Fathom: ``python -m bench <command>`` (see ``python -m bench --help``)."""
