"""The benchmark: the app against the raw limit, the seed design and its peers.

Run ``python -m benchmarks --help`` from the repository root; see README.md.
"""
