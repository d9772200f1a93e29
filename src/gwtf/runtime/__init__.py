"""The real runtime: wire codec, asyncio transport, node process, local launcher."""
