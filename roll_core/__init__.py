"""roll: reinforcement-learning post-training of LLMs, command line first."""

__version__ = "0.1.0"
