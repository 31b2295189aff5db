"""The vLLM project upstream: GitHub (commits, pull requests) and its published wheels."""
