"""Runnable examples (``python examples/rl_loop.py``); a package so tests can import their cores."""
