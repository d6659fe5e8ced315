"""The native conformance suite: a generated matrix of cases (matrix.py), each run at the Triton
level against float64 references on the same device (case.py), properties (properties.py), and a
runner of worker processes with crash isolation, JSONL results and the error budget (runner.py).
`python tools/conformance.py` is its command line; tools/gpu_validate.sh runs it natively.
"""
