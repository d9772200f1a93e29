"""Models (torch): GPT- and LLaMA-like families, presets, stage split, data, tokenizer.

`presets` and `partition` are pure (no torch) so the simulator can use them.
"""
