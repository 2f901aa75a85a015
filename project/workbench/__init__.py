"""The workbench: the pinned vLLM release plus ``patches/`` -> trees, wheels, PRs."""
