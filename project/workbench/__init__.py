"""The workbench: turns the pinned vLLM release plus ``patches/`` into trees, wheels and PRs."""
