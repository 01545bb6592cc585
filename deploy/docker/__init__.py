"""Docker deployment: base and node images, the deploy tool, compose, in-container helpers.

See docs/docker.md. `python -m deploy.docker.tool --help` is the entry point.
"""
