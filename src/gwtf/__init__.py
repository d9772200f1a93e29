"""gwtf: Go With The Flow, churn-tolerant decentralized pipeline training of LLMs."""

__version__ = "0.1.0"
