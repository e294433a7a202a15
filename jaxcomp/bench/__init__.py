"""Benchmarks: ``python -m jaxcomp.bench {compressors,pipeline,data_parallel,ab_training}``.

Each benchmark prints a table and, with ``--json PATH``, writes ``{"benchmark": ..., "env": ...,
"results": [...]}``. Speed is compared as ratios measured in the same run.
"""
