"""The measured results behind BENCHMARKS.md's tables, installed as the package `msds.results`
(setup.py) so that `msds plan` can read them outside a checkout; read them through msds/resources.py."""
