"""The sans-IO protocol core: messages, effects, NodeCore and its parts.

Must not import torch, asyncio, socket, threading or time.
"""
