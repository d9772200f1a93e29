"""The discrete-event simulator: engine, network/compute/churn models, scenarios, metrics.

Must not import torch, asyncio, socket, threading or time.
"""
