"""Helpers shared by the project's tests and benchmarks that need vLLM
(run with the python of a vLLM install; ``project/`` on ``sys.path``)."""
