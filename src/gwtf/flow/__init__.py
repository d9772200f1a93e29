"""Routing (pure): network data, node profiles, cost model, central optimum, baselines.

Must not import torch, asyncio, socket, threading or time.
"""
